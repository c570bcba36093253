"""Shared by the whole-loop benchmarks: one `run.py --experiment quickstart` run in a child process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quickstart(run_dir: Path, sets: Iterable[str]) -> subprocess.CompletedProcess[str]:
    """The quickstart into ``run_dir`` with ``--set`` overrides, no live display, no config watching."""
    cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
           "--set", 'monitor.display="off"']
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
