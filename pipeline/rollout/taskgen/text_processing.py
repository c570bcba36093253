"""Text processing: sort/unique lines, count a word, replace a word, extract e-mail addresses, filter lines."""

from __future__ import annotations

import random
import re
from typing import NamedTuple

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


class _Op(NamedTuple):
    """One operation's task: the file it reads, the workspace, what to do and how it is checked, and the file
    an oracle writes (with its text)."""

    src: str
    workspace: dict[str, str]
    instruction: str
    checks: list[dict]
    out_path: str
    out_text: str


def _sort_unique(rng: random.Random) -> _Op:
    src, dst = rng.choice(
        [("words.txt", "sorted.txt"), ("names.txt", "unique.txt"), ("items.txt", "out.txt")]
    )
    pool = rng.sample(_VOCAB, rng.randint(4, 9))
    lines = [rng.choice(pool) for _ in range(rng.randint(10, 25))]
    lines.append(lines[0])  # at least one duplicate
    result = sorted(set(lines))
    return _Op(
        src, {src: "\n".join(lines) + "\n"},
        f"Write the lines of {src}, sorted alphabetically and without duplicates, one per line, to {dst}.",
        [{"kind": "lines", "path": dst, "lines": result}], dst, "\n".join(result) + "\n",
    )


def _count_word(rng: random.Random) -> _Op:
    src = rng.choice(["story.txt", "text.txt", "essay.txt"])
    pool = rng.sample(_VOCAB, rng.randint(5, 10))
    word = rng.choice(pool)
    body = [" ".join(rng.choice(pool) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(3, 10))]
    text = "\n".join(body) + "\n"
    n = len(re.findall(rf"\b{word}\b", text))
    return _Op(
        src, {src: text},
        f"How many times does the word {word} occur in {src}? Write only the number to count.txt.",
        [{"kind": "number", "path": "count.txt", "value": float(n)}], "count.txt", f"{n}\n",
    )


def _replace_word(rng: random.Random) -> _Op:
    src = rng.choice(["notes.txt", "draft.txt", "letter.txt"])
    old, new = rng.sample(_VOCAB, 2)
    pool = [old, *rng.sample([w for w in _VOCAB if w not in (old, new)], 5)]
    body = [" ".join(rng.choice(pool) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(3, 8))]
    body[rng.randrange(len(body))] += f" {old}"  # the word occurs at least once
    text = "\n".join(body) + "\n"
    result_text = text.replace(old, new)
    return _Op(
        src, {src: text},
        f"In {src}, replace every occurrence of the word {old} with {new} (edit the file in place).",
        [{"kind": "text", "path": src, "text": result_text}], src, result_text,
    )


def _extract_emails(rng: random.Random) -> _Op:
    src = rng.choice(["contacts.txt", "people.txt", "team.txt"])
    emails = [f"{u}@{rng.choice(_DOMAINS)}" for u in rng.sample(_USERS, rng.randint(3, 7))]
    lines = []
    for e in emails + [rng.choice(emails)]:
        name = e.split("@")[0].capitalize()
        lines.append(rng.choice([f"{name} <{e}>", f"contact: {e}", f"{e} ({name})"]))
    lines += [f"note: call {rng.choice(_USERS)} on monday", "no address on this line"]
    rng.shuffle(lines)
    result = sorted(set(emails))
    return _Op(
        src, {src: "\n".join(lines) + "\n"},
        f"Extract every e-mail address from {src} and write them to emails.txt, one per line, "
        "sorted alphabetically, without duplicates.",
        [{"kind": "lines", "path": "emails.txt", "lines": result}], "emails.txt", "\n".join(result) + "\n",
    )


def _filter_lines(rng: random.Random) -> _Op:
    src = rng.choice(["app.log", "server.log", "run.log"])
    level = rng.choice(["ERROR", "WARN"])
    lines = [
        f"2026-01-{rng.randint(10, 28)} {rng.choice(_LEVELS)} {rng.choice(_VOCAB)} {rng.randint(1, 999)}"
        for _ in range(rng.randint(12, 30))
    ]
    lines[rng.randrange(len(lines))] = f"2026-01-09 {level} {rng.choice(_VOCAB)} {rng.randint(1, 999)}"
    dst = f"{level.lower()}s.txt"
    result = [ln for ln in lines if f" {level} " in ln]
    return _Op(
        src, {src: "\n".join(lines) + "\n"},
        f"Write every line of {src} that has level {level} to {dst}, keeping their order.",
        [{"kind": "lines", "path": dst, "lines": result}], dst, "\n".join(result) + "\n",
    )


# In the order the seed's generator picks from (changing it changes every task).
_OPS = {
    "sort_unique": _sort_unique,
    "count_word": _count_word,
    "replace_word": _replace_word,
    "extract_emails": _extract_emails,
    "filter_lines": _filter_lines,
}


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    op = _OPS[rng.choice(list(_OPS))](rng)
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=op.instruction,
        workspace=op.workspace,
        checks=op.checks,
        actions=[act("read_file", path=op.src), act("write_file", path=op.out_path, content=op.out_text)],
        category="text",
    )
