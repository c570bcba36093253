"""Small helpers of the sandbox backends: sizes ("4g"), output tails, the per-rollout directory, tars, pids."""

from __future__ import annotations

import io
import os
import re
import stat
import tarfile
import tempfile
import time
from pathlib import Path

from pipeline.core.logs import get_logger
from pipeline.core.runfiles import remove_prefixed, remove_tree, safe_name, strip_setid

log = get_logger(part="sandbox")

TAIL_CHARS = 1500  # how much of an output RolloutFinished.details keeps
HARNESS_OUTPUT = "harness.txt"  # the harness's output, in a kept rollout folder's logs/


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


def run_prefix(run_id: str) -> str:
    """What the name of every rollout directory of the backend with ``run_id`` starts with (``run_id`` cannot
    contain ``_``, so no other run's prefix starts with it)."""
    return f"bridle-{safe_name(run_id, 48)}_"


def rollout_dir(workdir: str, run_id: str, rollout_id: str) -> Path:
    """A fresh directory ``bridle-<run id>_<rollout id>-<random>`` for one rollout, under ``workdir`` (created if
    missing; default: the system temp dir). A restart of the run removes those a crash left
    (:func:`remove_run_dirs`)."""
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=rollout_dir_prefix(run_id, rollout_id), dir=workdir or None))


def rollout_dir_prefix(run_id: str, rollout_id: str) -> str:
    """What the name of ``rollout_id``'s directory starts with (a random suffix follows; ``run.py --view`` finds a
    kept one by it)."""
    return f"{run_prefix(run_id)}{re.sub(r'[^A-Za-z0-9_.-]', '_', rollout_id)[:40]}-"


def remove_run_dirs(workdir: str, run_id: str) -> int:
    """Remove every rollout directory of ``run_id`` under ``workdir`` (default: the system temp dir)."""
    return len(remove_prefixed(workdir or tempfile.gettempdir(), run_prefix(run_id)))


def keep_or_remove(path: Path | None, keep: bool) -> None:
    """The end of a rollout's folder: kept (``keep_workspaces``) without setuid or setgid bits, else removed."""
    if path is None:
        return
    if keep:
        strip_setid(path)
    else:
        rmtree(path)


def rmtree(path: Path | None) -> None:
    """Remove a rollout's folder whatever the policy left in it (:func:`remove_tree`); never raises."""
    if path is not None and not remove_tree(path):
        log.warning("could not remove a rollout folder", path=str(path))


def tar_files(files: dict[str, tuple[bytes, int]]) -> bytes:
    """An in-memory tar of absolute container paths -> (content, mode), for put_archive at "/"."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs: set[str] = set()
        for path in files:
            parts = Path(path.lstrip("/")).parts[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
            tar.addfile(info)
        for path, (data, mode) in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
