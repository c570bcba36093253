"""Small helpers both sandbox backends use: sizes ("4g"), output tails, the per-rollout directory."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

TAIL_CHARS = 1500  # how much of an output RolloutFinished.details keeps


def parse_size(text: str | int | None, field: str) -> int | None:
    """"4g" / "512m" / "1024k" / 123 -> bytes; ``field`` names the setting in the error."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise ValueError(f'{field}: expected a size such as "4g", "512m" or a number of bytes, got {text!r}')
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    """The last ``limit`` characters of ``text``, marked with "..." when cut."""
    return text if len(text) <= limit else "..." + text[-limit:]


def file_tail(path: Path, limit: int = TAIL_CHARS) -> str:
    """:func:`tail` of a file's text, reading only its end; "" when it does not exist. A link in its place (the
    harness may swap its output file for one) is not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"({path.name} could not be read: {e.strerror})"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"({path.name} is not a regular file)"
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - limit * 4))  # up to 4 bytes per character in UTF-8
        return tail(f.read().decode("utf-8", "replace"), limit)


def rollout_dir(workdir: str, rollout_id: str) -> Path:
    """A fresh directory ``bridle-<rollout id>-<random>`` for one rollout, under ``workdir`` (created if missing;
    default: the system temp dir)."""
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", rollout_id)[:40]
    return Path(tempfile.mkdtemp(prefix=f"bridle-{safe}-", dir=workdir or None))


def rmtree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
