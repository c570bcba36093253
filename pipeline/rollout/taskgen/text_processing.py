"""Text processing: sort/unique lines, count a word, replace a word, extract e-mail addresses, filter lines."""

from __future__ import annotations

import re

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import TaskSpec

FAMILY = "text_processing"
DIFFICULTY = "easy"
DESCRIPTION = "sort-unique, count, replace, extract e-mails or filter lines of a text file"

# No word is a substring of another, so "whole word" and "substring" counts agree.
_VOCAB = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "piano",
    "lemon",
    "robot",
    "castle",
    "garden",
    "window",
    "marble",
    "violet",
    "copper",
    "falcon",
    "harbor",
    "island",
    "jungle",
    "meadow",
    "pepper",
]
_USERS = ["ana", "bo", "chen", "dara", "emil", "fred", "gita", "hugo", "iris", "jon", "kira", "liam"]
_DOMAINS = ["example.com", "mail.org", "corp.net", "uni.edu"]
_LEVELS = ["INFO", "DEBUG", "WARN", "ERROR"]


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    op = rng.choice(["sort_unique", "count_word", "replace_word", "extract_emails", "filter_lines"])
    if op == "sort_unique":
        src, dst = rng.choice(
            [("words.txt", "sorted.txt"), ("names.txt", "unique.txt"), ("items.txt", "out.txt")]
        )
        pool = rng.sample(_VOCAB, rng.randint(4, 9))
        lines = [rng.choice(pool) for _ in range(rng.randint(10, 25))]
        lines.append(lines[0])  # at least one duplicate
        ws = {src: "\n".join(lines) + "\n"}
        result = sorted(set(lines))
        instruction = (
            f"Write the lines of {src}, sorted alphabetically and without duplicates, one per line, to {dst}."
        )
        checks = [{"kind": "lines", "path": dst, "lines": result}]
        out_path, out_text = dst, "\n".join(result) + "\n"
    elif op == "count_word":
        src = rng.choice(["story.txt", "text.txt", "essay.txt"])
        pool = rng.sample(_VOCAB, rng.randint(5, 10))
        word = rng.choice(pool)
        body = [
            " ".join(rng.choice(pool) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(3, 10))
        ]
        ws = {src: "\n".join(body) + "\n"}
        n = len(re.findall(rf"\b{word}\b", ws[src]))
        instruction = (
            f"How many times does the word {word} occur in {src}? Write only the number to count.txt."
        )
        checks = [{"kind": "number", "path": "count.txt", "value": float(n)}]
        out_path, out_text = "count.txt", f"{n}\n"
    elif op == "replace_word":
        src = rng.choice(["notes.txt", "draft.txt", "letter.txt"])
        old, new = rng.sample(_VOCAB, 2)
        pool = [old, *rng.sample([w for w in _VOCAB if w not in (old, new)], 5)]
        body = [
            " ".join(rng.choice(pool) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(3, 8))
        ]
        body[rng.randrange(len(body))] += f" {old}"  # the word occurs at least once
        ws = {src: "\n".join(body) + "\n"}
        result_text = ws[src].replace(old, new)
        instruction = (
            f"In {src}, replace every occurrence of the word {old} with {new} (edit the file in place)."
        )
        checks = [{"kind": "text", "path": src, "text": result_text}]
        out_path, out_text = src, result_text
    elif op == "extract_emails":
        src = rng.choice(["contacts.txt", "people.txt", "team.txt"])
        emails = [f"{u}@{rng.choice(_DOMAINS)}" for u in rng.sample(_USERS, rng.randint(3, 7))]
        lines = []
        for e in emails + [rng.choice(emails)]:
            name = e.split("@")[0].capitalize()
            lines.append(rng.choice([f"{name} <{e}>", f"contact: {e}", f"{e} ({name})"]))
        lines += [f"note: call {rng.choice(_USERS)} on monday", "no address on this line"]
        rng.shuffle(lines)
        ws = {src: "\n".join(lines) + "\n"}
        result = sorted(set(emails))
        instruction = (
            f"Extract every e-mail address from {src} and write them to emails.txt, one per line, "
            "sorted alphabetically, without duplicates."
        )
        checks = [{"kind": "lines", "path": "emails.txt", "lines": result}]
        out_path, out_text = "emails.txt", "\n".join(result) + "\n"
    else:
        src = rng.choice(["app.log", "server.log", "run.log"])
        level = rng.choice(["ERROR", "WARN"])
        lines = [
            f"2026-01-{rng.randint(10, 28)} {rng.choice(_LEVELS)} {rng.choice(_VOCAB)} {rng.randint(1, 999)}"
            for _ in range(rng.randint(12, 30))
        ]
        lines[rng.randrange(len(lines))] = f"2026-01-09 {level} {rng.choice(_VOCAB)} {rng.randint(1, 999)}"
        ws = {src: "\n".join(lines) + "\n"}
        dst = f"{level.lower()}s.txt"
        result = [ln for ln in lines if f" {level} " in ln]
        instruction = f"Write every line of {src} that has level {level} to {dst}, keeping their order."
        checks = [{"kind": "lines", "path": dst, "lines": result}]
        out_path, out_text = dst, "\n".join(result) + "\n"
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=instruction,
        workspace=ws,
        checks=checks,
        actions=[act("read_file", path=src), act("write_file", path=out_path, content=out_text)],
        category="text",
    )
