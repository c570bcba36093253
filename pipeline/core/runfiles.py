"""What a run keeps on this host outside its run folder, named so that a restart of the run can find it.

Sandbox workspaces, the proxy's Unix-socket folder, sandbox processes (environment ``BRIDLE_SANDBOX_RUN``) and
containers (label ``bridle.run``) carry the run's :func:`run_tag`. A fresh start and ``run.py --resume`` of the same
run folder compute the same tag, so each component removes what a crashed (``kill -9``) earlier start of this run
left before it starts anew, and never touches another run's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path


def safe_name(text: str, limit: int) -> str:
    """``text`` as a file-name part: letters, digits, ``.`` and ``-`` only, at most ``limit`` characters."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", text)[:limit]


def run_tag(run_dir: str | Path | None) -> str:
    """The same on every start of one run folder, different between folders: the folder's name (cut to 24
    characters; Unix socket paths must stay under 108 bytes) and a hash of its absolute path. Without a run folder,
    a random tag (nothing to resume)."""
    if run_dir is None:
        return uuid.uuid4().hex[:12]
    path = Path(run_dir).resolve()
    return f"{safe_name(path.name, 24)}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


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
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                Path(e.path).unlink(missing_ok=True)
    return found
