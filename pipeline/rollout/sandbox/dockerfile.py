"""What a task's ``environment/Dockerfile`` builds on, read without building it (pipeline/rollout/sandbox/task_images.py).

bridle builds task images offline: the engine must never try to pull. So before a build, every image the Dockerfile
names (each ``FROM`` that is not an earlier stage or ``scratch``, and each ``COPY --from=`` that is not a stage) is
found here, with the global ``ARG`` defaults substituted as Docker does, and checked to exist on this machine. A
missing one may be replaced by a local image (``[sandbox.docker] base_images``): :func:`substitute` rewrites those
lines of a copy of the Dockerfile, never the task's own file.

Only what decides the base images is parsed: line continuations, comments, ``ARG`` before the first ``FROM``,
``FROM [--platform=...] IMAGE [AS NAME]`` and ``COPY --from=``. The default escape character ``\\`` is assumed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:[-+])?(?P<word>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(ValueError):
    """The Dockerfile cannot be read as far as bridle needs to (no FROM, a FROM without an image)."""


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the logical line, continuations joined
    first: int  # its physical lines, 0-based, [first, last]
    last: int


@dataclass(frozen=True)
class BaseRef:
    """One image the Dockerfile needs from the machine."""

    image: str  # as written after substituting ARGs ("debian:bookworm-slim")
    line: int  # 1-based line of its instruction, for error messages
    index: int  # which instruction (for substitute)
    kind: str  # "FROM" or "COPY --from"


def instructions(text: str) -> list[Instruction]:
    """The logical instructions of ``text`` (continuations joined, comments and blank lines dropped)."""
    lines = text.splitlines()
    out: list[Instruction] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        first, parts = i, []
        while True:
            line = lines[i].rstrip()
            if i > first and (not line.strip() or line.strip().startswith("#")):
                # A comment or blank line inside a continuation is skipped; the instruction goes on after it.
                if i + 1 >= len(lines):
                    break
                i += 1
                continue
            cont = line.endswith("\\")
            parts.append(line[:-1] if cont else line)
            if not cont or i + 1 >= len(lines):
                break
            i += 1
        keyword, _, args = " ".join(p.strip() for p in parts).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), first, i))
        i += 1
    return out


def _expand(word: str, args: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        value = args.get(name, "")
        op = m.group("op")
        if op == ":-":
            return value or m.group("word")
        if op == ":+":
            return m.group("word") if value else ""
        return value

    return _VAR.sub(one, word)


def _global_args(insts: list[Instruction], build_args: dict[str, str]) -> dict[str, str]:
    """ARG defaults declared before the first FROM (the only ones a FROM line can use), overridden by build args."""
    found: dict[str, str] = {}
    for inst in insts:
        if inst.keyword == "FROM":
            break
        if inst.keyword != "ARG":
            continue
        for decl in inst.args.split():
            name, eq, default = decl.partition("=")
            found[name] = build_args.get(name, default.strip("\"'") if eq else "")
    return found


def _from_parts(args: str) -> tuple[str, str, str]:
    """(flags, image, " AS name" or "") of a FROM instruction's arguments."""
    words = args.split()
    flags = [w for w in words if w.startswith("--")]
    rest = [w for w in words if not w.startswith("--")]
    if not rest:
        raise DockerfileError("a FROM instruction names no image")
    alias = f" AS {rest[2]}" if len(rest) >= 3 and rest[1].lower() == "as" else ""
    return " ".join(flags), rest[0], alias


def base_images(text: str, build_args: dict[str, str] | None = None) -> list[BaseRef]:
    """Every image ``text`` builds on that must come from the machine, in order."""
    insts = instructions(text)
    args = _global_args(insts, build_args or {})
    stages: set[str] = set()
    refs: list[BaseRef] = []
    n_from = 0
    for idx, inst in enumerate(insts):
        if inst.keyword == "FROM":
            _flags, raw, alias = _from_parts(inst.args)
            image = _expand(raw, args)
            if not image:
                raise DockerfileError(f"line {inst.first + 1}: FROM {raw} names no image once its ARGs are "
                                      "substituted; give the ARG a default")
            if image.lower() not in stages and image != "scratch":
                refs.append(BaseRef(image, inst.first + 1, idx, "FROM"))
            if alias:
                stages.add(alias.split()[-1].lower())
            n_from += 1
        elif inst.keyword in ("COPY", "ADD"):
            for w in inst.args.split():
                if w.startswith("--from="):
                    src = w.removeprefix("--from=")
                    if src.lower() not in stages and not src.isdigit():
                        refs.append(BaseRef(src, inst.first + 1, idx, "COPY --from"))
    if n_from == 0:
        raise DockerfileError("it has no FROM instruction")
    return refs


def substitute(text: str, replace: dict[int, str]) -> str:
    """``text`` with the images of the instructions ``replace`` names (BaseRef.index -> local image) swapped.

    A replaced instruction becomes one line (``FROM [flags] NEW [AS name]``, or the COPY with ``--from=NEW``); every
    other line stays as it was, so line numbers in the engine's errors only shift after a replaced continuation."""
    if not replace:
        return text
    lines = text.splitlines()
    insts = instructions(text)
    for idx in sorted(replace, reverse=True):
        inst = insts[idx]
        if inst.keyword == "FROM":
            flags, _image, alias = _from_parts(inst.args)
            new = " ".join(p for p in ("FROM", flags, replace[idx]) if p) + alias
        else:
            words = [f"--from={replace[idx]}" if w.startswith("--from=") else w for w in inst.args.split()]
            new = f"{inst.keyword} {' '.join(words)}"
        lines[inst.first: inst.last + 1] = [new]
    return "\n".join(lines) + "\n"
