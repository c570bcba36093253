"""What a run keeps on this host outside its run folder, named so that a restart of the run can find it.

Sandbox workspaces, the proxy's Unix-socket folder, sandbox processes (environment ``BRIDLE_SANDBOX_RUN``), learner
ranks (environment ``BRIDLE_LEARNER_RANKS``) and containers (label ``bridle.run``) carry the run's :func:`run_tag`.
A fresh start and ``run.py --resume`` of the same run folder compute the same tag, so each component removes what a
crashed (``kill -9``) earlier start of this run left before it starts anew, and never touches another run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path


def safe_name(text: str, limit: int) -> str:
    """``text`` as a file-name part: letters, digits, ``.`` and ``-`` only, at most ``limit`` characters."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", text)[:limit]


SFT_CHECKPOINT = "sft"  # checkpoints/sft00040: the cold start after 40 SFT updates ([learner].sft_checkpoint_every)


def run_tag(run_dir: str | Path | None) -> str:
    """The same on every start of one run folder, different between folders: the folder's name (cut to 24
    characters; Unix socket paths must stay under 108 bytes) and a hash of its absolute path. Without a run folder,
    a random tag (nothing to resume)."""
    if run_dir is None:
        return uuid.uuid4().hex[:12]
    path = Path(run_dir).resolve()
    return f"{safe_name(path.name, 24)}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def remove_tree(path: str | Path) -> bool:
    """Remove ``path`` (a folder of any depth, a file, a link: never followed); True when it is gone. Never raises.

    A policy controls what its workspace holds: a folder chain thousands deep makes ``shutil.rmtree`` raise
    ``RecursionError`` on Python 3.11, and folders it made unwritable or unsearchable stop a plain removal. GNU
    ``rm`` walks any depth without recursion; folders it could not enter are made enterable (``chmod -R u+rwx``,
    which does not follow links) and removed again."""
    p = Path(path)
    try:
        if not os.path.lexists(p):
            return True
        if p.is_symlink() or not p.is_dir():
            p.unlink()
            return True
    except OSError:
        return not os.path.lexists(p)
    for cmd in (["rm", "-rf", "--one-file-system", "--", str(p)],
                ["chmod", "-R", "u+rwx", "--", str(p)],
                ["rm", "-rf", "--one-file-system", "--", str(p)]):
        if not os.path.lexists(p):
            return True
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=600, check=False)
    return not os.path.lexists(p)


def strip_setid(path: str | Path) -> None:
    """Clear the setuid and setgid bits of everything under ``path`` (links are not followed): a kept rollout folder
    is the sandbox's work, and a setuid binary in it would run as its owner for whoever starts it. Never raises."""
    if os.path.isdir(path) and not os.path.islink(path):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["chmod", "-R", "u-s,g-s", "--", str(path)], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False)


def remove_prefixed(parent: str | Path, prefix: str) -> list[Path]:
    """Remove every entry of ``parent`` whose name starts with ``prefix``; return what was there. A missing
    ``parent`` holds nothing; what cannot be removed (another user's files) stays, silently."""
    found: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return found
    for e in entries:
        if e.name.startswith(prefix):
            found.append(Path(e.path))
            remove_tree(e.path)
    return found


def marked_pids(marker: bytes) -> list[int]:
    """Processes of this user whose environment contains ``marker`` (``NAME=value``); empty without /proc."""
    found: list[int] = []
    needle = b"\0" + marker + b"\0"
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for e in entries:
        if not e.isdigit() or int(e) == me:
            continue
        try:
            with open(f"/proc/{e}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in b"\0" + env:
            found.append(int(e))
    return found


def kill_marked(marker: str, rounds: int = 5) -> int:
    """SIGKILL every process carrying ``marker`` in its environment, until none is left; return how many."""
    killed = 0
    for _ in range(rounds):
        pids = marked_pids(marker.encode())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return killed
