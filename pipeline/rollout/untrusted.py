"""Reading what a sandbox wrote, on the host: never through a link, only regular files, size-capped, never quoted.

Whatever runs in a sandbox (the harness, and workspace code a verifier imports) can leave a symbolic link where the
host expects a file (``logs/verifier/reward.txt -> /home/you/.ssh/id_ed25519``) or swap a folder for one. Below a
base folder the host trusts (one it made itself), every path component is opened with ``O_NOFOLLOW`` relative to
its parent's descriptor; the file must be regular (``fstat``: no FIFO that blocks, no device) and is read up to a
cap. Errors name the file and its size, never its content: what a sandbox wrote never reaches an error message,
``RolloutFinished.details`` or the event log (reward part names excepted, which must be short plain names).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

REWARD_CAP = 4096  # bytes: a reward file is one number or a small JSON object
MAX_REWARD_PARTS = 32
_PART_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


class UntrustedFileError(ValueError):
    """A file the sandbox wrote is not what the host may read (a link, not a regular file, too large)."""


class RewardError(ValueError):
    """The verifier left no valid reward."""


def _flags(last: bool) -> int:
    base = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    return base | (os.O_NONBLOCK if last else os.O_DIRECTORY)


def open_under(base: Path, rel: str | PurePosixPath) -> int:
    """A read-only descriptor of ``base/rel``, no component of ``rel`` being a symbolic link (the caller closes it).

    ``base`` is trusted (made by the host); ``rel`` must stay below it. Raises FileNotFoundError when something is
    missing, UntrustedFileError when a component is a link (or a non-folder where a folder should be).
    """
    parts = PurePosixPath(rel).parts
    if not parts or any(p in ("", ".", "..", "/") for p in parts):
        raise ValueError(f"{rel!r}: expected a relative path below {base}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _flags(i == len(parts) - 1), dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EMLINK):
                    where = "/".join(parts[: i + 1])
                    raise UntrustedFileError(f"{where} is a symbolic link or not a regular file") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_under(base: Path, rel: str | PurePosixPath, cap: int, *, head: bool = False) -> bytes:
    """The bytes of the regular file ``base/rel`` (see :func:`open_under`): UntrustedFileError when it has more
    than ``cap``, or with ``head`` its first ``cap`` bytes."""
    fd = open_under(base, rel)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(f"{rel} is not a regular file")
        if head:
            return os.pread(fd, cap, 0)
        if st.st_size > cap:
            raise UntrustedFileError(f"{rel} has {st.st_size} bytes, more than the {cap} allowed")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(cap + 1)
        if len(data) > cap:  # it grew meanwhile
            raise UntrustedFileError(f"{rel} has more than the {cap} bytes allowed")
        return data
    finally:
        os.close(fd)


def printable(text: str) -> str:
    """``text`` without control characters other than newline and tab (terminal escapes, NULs)."""
    return _CONTROL.sub("?", text)


# ---------------------------------------------------------------------------------------------- reward
def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"{where}: expected a number, got a {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise RewardError(f"{where}: reward must be finite, got {x}")
    return x


def _reward_file(verifier_dir: Path, name: str) -> bytes | None:
    """The content of ``verifier_dir/name`` (None when absent); the folder itself must not be a link either."""
    try:
        return read_under(verifier_dir.parent, f"{verifier_dir.name}/{name}", REWARD_CAP)
    except FileNotFoundError:
        return None
    except UntrustedFileError as e:
        raise RewardError(f"{name}: {e}; not read") from None
    except OSError as e:
        raise RewardError(f"{name}: cannot be read ({e.strerror})") from None


def _parse_txt(data: bytes) -> float:
    try:
        value = float(data.decode("utf-8").strip())
    except (UnicodeDecodeError, ValueError):
        raise RewardError(f"reward.txt is not one number ({len(data)} bytes)") from None
    return _number(value, "reward.txt")


def _parse_json(data: bytes) -> tuple[float, dict[str, float]]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RewardError(f"reward.json is not valid JSON ({len(data)} bytes)") from None
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return _number(obj, "reward.json"), {}
    if not isinstance(obj, dict) or not obj:
        raise RewardError('reward.json: expected an object like {"reward": 1.0}')
    if len(obj) > MAX_REWARD_PARTS:
        raise RewardError(f"reward.json: {len(obj)} keys, at most {MAX_REWARD_PARTS} allowed")
    parts: dict[str, float] = {}
    for i, (k, v) in enumerate(obj.items()):
        if not _PART_NAME.fullmatch(k):
            raise RewardError(f"reward.json: key #{i + 1} is not a plain name (letters, digits, _ . : -, <= 64)")
        parts[k] = _number(v, f"reward.json key {k!r}")
    if "reward" in parts:
        return parts.pop("reward"), parts
    return sum(parts.values()) / len(parts), parts


def read_reward(verifier_dir: Path) -> tuple[float, dict[str, float]]:
    """Read ``reward.txt`` (one number) or else ``reward.json`` (``{"reward": x, ...}`` or named parts).

    With reward.json and no ``reward`` key the reward is the mean of the named parts. ``verifier_dir``'s parent is
    trusted; ``verifier_dir`` and the files are opened without following links. Errors never quote the content.
    """
    txt = _reward_file(verifier_dir, "reward.txt")
    if txt is not None:
        return _parse_txt(txt), {}
    js = _reward_file(verifier_dir, "reward.json")
    if js is not None:
        return _parse_json(js)
    raise RewardError("test.sh wrote neither logs/verifier/reward.txt nor reward.json")


# --------------------------------------------------------------------------------------------- folders
def fresh_dir(path: Path, mode: int = 0o755) -> Path:
    """Make ``path`` an empty folder of its own: a link or file there is removed, not followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, mode=mode)
    path.chmod(mode)
    return path


def walk_files(root: Path) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry below ``root`` that is not a folder, links included, sorted; links
    to folders are not entered."""
    found: list[tuple[str, os.stat_result]] = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in files + [d for d in dirs if (Path(dirpath) / d).is_symlink()]:
            p = Path(dirpath) / name
            try:
                found.append(((rel_dir / name).as_posix(), p.lstat()))
            except OSError:
                continue
    return sorted(found)
