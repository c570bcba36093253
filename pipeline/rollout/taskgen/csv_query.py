"""Data questions over a generated CSV file; the answer goes into answer.txt."""

from __future__ import annotations

import csv
import io

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import TaskSpec

FAMILY = "csv_query"
DIFFICULTY = "medium"
DESCRIPTION = "answer a count/sum/average/argmax/distinct question about a CSV file in answer.txt"

_FIRST = [
    "Ana",
    "Ben",
    "Cleo",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivo",
    "Jun",
    "Kai",
    "Lea",
    "Max",
    "Nia",
    "Oto",
    "Pia",
    "Quin",
    "Ria",
    "Sam",
    "Tess",
    "Uma",
    "Vik",
    "Wes",
    "Xia",
    "Yul",
    "Zoe",
]
_LAST = ["Ito", "Berg", "Cruz", "Diaz", "Egan", "Fox", "Gray", "Hale", "Ives", "Jain", "Kim", "Lund", "Moss"]
_CITIES = ["Oslo", "Lima", "Pune", "Kyiv", "Riga", "Doha", "Rome", "Baku", "Bern", "Cork"]
_DEPTS = ["sales", "ops", "research", "support", "finance", "legal"]


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    n = rng.randint(12, 40)
    cities = rng.sample(_CITIES, rng.randint(3, 6))
    depts = rng.sample(_DEPTS, rng.randint(2, 4))
    names = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], n)
    rows = [
        {
            "id": i + 1,
            "name": names[i],
            "city": rng.choice(cities),
            "dept": rng.choice(depts),
            "age": rng.randint(19, 66),
            "score": rng.randint(0, 1000),
        }
        for i in range(n)
    ]
    fname = rng.choice(["people.csv", "staff.csv", "data.csv", "records.csv"])
    q = rng.choice(["count_city", "sum_dept", "avg_age", "top_score", "distinct_cities", "max_age_city"])
    tol = 0.0
    if q == "count_city":
        c = rng.choice(cities)
        question = f"How many rows of {fname} have city {c}?"
        answer: str = str(sum(r["city"] == c for r in rows))
    elif q == "sum_dept":
        d = rng.choice(depts)
        question = f"What is the total score of the rows of {fname} whose dept is {d}?"
        answer = str(sum(r["score"] for r in rows if r["dept"] == d))
    elif q == "avg_age":
        question = f"What is the average age in {fname}, rounded to 2 decimal places?"
        answer = f"{sum(r['age'] for r in rows) / n:.2f}"
        tol = 0.005
    elif q == "top_score":
        # The winner must be unique, so nudge ties away by giving the first best a higher score.
        best = max(rows, key=lambda r: r["score"])
        best["score"] = max(r["score"] for r in rows if r is not best) + rng.randint(1, 9)
        question = f"What is the name of the person with the highest score in {fname}?"
        answer = best["name"]
    elif q == "distinct_cities":
        question = f"How many different cities appear in {fname}?"
        answer = str(len({r["city"] for r in rows}))
    else:
        c = rng.choice(cities)
        ages = [r["age"] for r in rows if r["city"] == c]
        question = f"What is the highest age among the rows of {fname} with city {c}? (0 if there are none)"
        answer = str(max(ages) if ages else 0)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    if q == "top_score":
        check = {"kind": "text", "path": "answer.txt", "text": answer, "match": "strip"}
    else:
        check = {"kind": "number", "path": "answer.txt", "value": float(answer), "tol": tol}
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=f"{question} Write only the answer into answer.txt.",
        workspace={fname: buf.getvalue()},
        checks=[check],
        actions=[act("read_file", path=fname), act("write_file", path="answer.txt", content=answer)],
        category="data",
    )
