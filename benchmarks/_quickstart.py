"""Shared by the whole-loop benchmarks: one `run.py` run (the quickstart, or any experiment) in a child process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quickstart(run_dir: Path, sets: Iterable[str]) -> subprocess.CompletedProcess[str]:
    """The quickstart into ``run_dir`` with ``--set`` overrides, no live display, no config watching."""
    cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
           "--set", 'monitor.display="off"']
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def run_logged(args: Sequence[str], sets: Iterable[str], log: Path) -> None:
    """``run.py ARGS`` with ``--set`` overrides and no live display, its output to ``log`` (a long run's output is
    kept on disk, not in memory); raises RuntimeError with the log's end when it fails."""
    cmd = [sys.executable, "run.py", *args, "--set", 'monitor.display="off"']
    for s in sets:
        cmd += ["--set", s]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run.py {' '.join(args)} exited {r.returncode}; log {log}:\n{tail}")
