"""Procedurally generated task families, materialized in the Harbor task format.

``generate(family, seed)`` returns a :class:`~pipeline.rollout.tasks.TaskSpec` (an in-memory task folder); the same
(family, seed) always gives the same task. ``generate_to(out, families, n, seed)`` writes ``n`` instances per
family as ``out/<family>-<seed>/``. Each task carries ``[metadata] family/difficulty/seed``, a hidden checker in
``tests/``, and its oracle as ``solution/solve.sh`` plus ``solution/actions.json`` (neutral tool calls).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from pipeline.rollout.taskgen import (
    bugfix,
    config_edit,
    create_file,
    create_word,
    csv_query,
    file_ops,
    text_processing,
)
from pipeline.rollout.tasks import Task, TaskSpec, materialize

FAMILIES: dict[str, ModuleType] = {
    m.FAMILY: m for m in (create_word, create_file, file_ops, text_processing, config_edit, csv_query, bugfix)
}


def family_names() -> list[str]:
    return list(FAMILIES)


def resolve_families(spec: str | Iterable[str]) -> list[str]:
    """``"all"``, ``"a,b"`` or a list of names -> validated family names."""
    names = list(FAMILIES) if spec == "all" else (spec.split(",") if isinstance(spec, str) else list(spec))
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise ValueError(
            f"unknown task family {unknown or names!r}; choose from {', '.join(FAMILIES)} or 'all'"
        )
    return names


def generate(family: str, seed: int) -> TaskSpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose from {', '.join(FAMILIES)}")
    return FAMILIES[family].generate(seed)


def generate_to(out: str | Path, families: str | Iterable[str], n: int, seed: int = 0) -> list[Task]:
    """Write seeds ``seed .. seed+n-1`` of each family under ``out``; return the loaded tasks."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [
        materialize(generate(f, s), out / f"{f}-{s}")
        for f in resolve_families(families)
        for s in range(seed, seed + n)
    ]
