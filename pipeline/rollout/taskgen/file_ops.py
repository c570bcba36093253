"""File operations: rename, move by extension, delete by pattern, copy to a backup, concatenate, make dirs."""

from __future__ import annotations

import random

from pipeline.rollout.taskgen.common import act, build_task, rng_for
from pipeline.rollout.tasks import TaskSpec

FAMILY = "file_ops"
DIFFICULTY = "easy"
DESCRIPTION = "move/rename/copy/delete/concatenate files and create directories (oracle: one bash call)"

_STEMS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "notes",
    "report",
    "draft",
    "summary",
    "index",
    "main",
    "old",
    "temp",
]
_WORDS = ["lorem", "ipsum", "data", "value", "north", "south", "east", "west", "one", "two", "three", "four"]


def _text(rng: random.Random) -> str:
    return (
        "\n".join(
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 4))
        )
        + "\n"
    )


def _names(rng: random.Random, k: int, ext: str) -> list[str]:
    return [s + ext for s in rng.sample(_STEMS, k)]


def generate(seed: int) -> TaskSpec:
    rng = rng_for(FAMILY, seed)
    op = rng.choice(["rename", "move_ext", "delete_ext", "backup", "concat", "mkdirs"])
    ws: dict[str, str] = {}
    checks: list[dict] = []
    if op == "rename":
        src, dst = _names(rng, 2, rng.choice([".txt", ".md", ".csv"]))
        ws[src] = _text(rng)
        for other in _names(rng, 2, ".log"):
            ws[other] = _text(rng)
        instruction = f"Rename {src} to {dst}."
        command = f"mv {src} {dst}"
        checks = [{"kind": "text", "path": dst, "text": ws[src]}, {"kind": "absent", "path": src}]
        checks += [{"kind": "text", "path": o, "text": t} for o, t in ws.items() if o != src]
    elif op == "move_ext":
        ext, other_ext = rng.sample([".log", ".txt", ".csv", ".json"], 2)
        folder = rng.choice(["archive", "logs", "old", "store"])
        moved = _names(rng, rng.randint(2, 4), ext)
        kept = [s for s in _names(rng, rng.randint(1, 3), other_ext)]
        for n in moved + kept:
            ws[n] = _text(rng)
        instruction = f"Move every {ext} file in the current directory into a new directory named {folder}/."
        command = f"mkdir -p {folder} && mv *{ext} {folder}/"
        checks = [{"kind": "dir", "path": folder}]
        checks += [{"kind": "text", "path": f"{folder}/{n}", "text": ws[n]} for n in moved]
        checks += [{"kind": "absent", "path": n} for n in moved]
        checks += [{"kind": "text", "path": n, "text": ws[n]} for n in kept]
    elif op == "delete_ext":
        ext = rng.choice([".tmp", ".bak", ".swp"])
        sub = rng.choice(["src", "docs", "build"])
        doomed = [n for n in _names(rng, 2, ext)] + [
            f"{sub}/{n}" for n in _names(rng, rng.randint(1, 2), ext)
        ]
        kept = _names(rng, 2, ".txt") + [f"{sub}/{n}" for n in _names(rng, 1, ".md")]
        for n in doomed + kept:
            ws[n] = _text(rng)
        instruction = (
            f"Delete every {ext} file in the current directory and its subdirectories. Keep all other files."
        )
        command = f"find . -type f -name '*{ext}' -delete"
        checks = [{"kind": "absent", "path": n} for n in doomed]
        checks += [{"kind": "text", "path": n, "text": ws[n]} for n in kept]
    elif op == "backup":
        name = rng.choice(["config.ini", "settings.json", "app.conf", "hosts.txt"])
        folder = rng.choice(["backup", "bak", "saved"])
        ws[name] = _text(rng)
        instruction = f"Copy {name} to {folder}/{name}.bak (create {folder}/). Keep the original."
        command = f"mkdir -p {folder} && cp {name} {folder}/{name}.bak"
        checks = [
            {"kind": "text", "path": f"{folder}/{name}.bak", "text": ws[name]},
            {"kind": "text", "path": name, "text": ws[name]},
        ]
    elif op == "concat":
        parts = [f"part{i}.txt" for i in range(1, rng.randint(3, 5))]
        for p in parts:
            ws[p] = _text(rng)
        order = parts[:] if rng.random() < 0.5 else parts[::-1]
        target = rng.choice(["full.txt", "all.txt", "joined.txt"])
        instruction = f"Concatenate {', '.join(order)} in that order into a new file {target}."
        command = f"cat {' '.join(order)} > {target}"
        checks = [{"kind": "text", "path": target, "text": "".join(ws[p] for p in order)}]
    else:
        depth = rng.randint(2, 3)
        path = "/".join(rng.sample(["src", "lib", "core", "util", "app", "pkg", "data", "cfg"], depth))
        marker = rng.choice(["__init__.py", "README.md", ".keep"])
        ws["README.md"] = _text(rng)
        instruction = f"Create the directory {path}/ (with its parents) and an empty file {path}/{marker}."
        command = f"mkdir -p {path} && touch {path}/{marker}"
        checks = [{"kind": "dir", "path": path}, {"kind": "text", "path": f"{path}/{marker}", "text": ""}]
    return build_task(
        family=FAMILY,
        seed=seed,
        difficulty=DIFFICULTY,
        instruction=instruction,
        workspace=ws,
        checks=checks,
        actions=[act("bash", command=command)],
    )
