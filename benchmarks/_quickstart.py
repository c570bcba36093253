"""Shared by the whole-loop benchmarks: one `run.py` run (the quickstart, or any experiment) in a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHILD_GRACE_S = 120.0  # run.py stops its sandboxes and engine on SIGTERM; after this it is killed
_LIVE: set[subprocess.Popen[Any]] = set()  # run_child's children still running, from every thread
_LIVE_LOCK = threading.Lock()


def _stop_children(signum: int, frame: FrameType | None) -> None:
    """SIGTERM to a benchmark: passed on to every child still running (evaluations run in worker threads, which
    signals never interrupt), then the main thread is interrupted."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        proc.send_signal(signal.SIGTERM)  # a no-op for one that has ended
    raise KeyboardInterrupt(f"signal {signum}")


def run_child(cmd: Sequence[str], **popen: Any) -> subprocess.CompletedProcess[Any]:
    """``cmd`` in ``ROOT``, a child that does not outlive this process.

    A benchmark is stopped with SIGTERM (``kill``, ``timeout``) as often as with Ctrl-C, and a plain
    ``subprocess.run`` would leave its ``run.py`` running on, orphaned, holding the CPU and its sandboxes. Here
    SIGTERM (once a child was started from the main thread, which installs the handler) reaches every running child
    as SIGTERM; Ctrl-C or an error while waiting stops this call's child the same way; a child that has not stopped
    within CHILD_GRACE_S is killed; then the interruption goes on up.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop_children)
    with subprocess.Popen(cmd, cwd=ROOT, **popen) as proc:
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            out, err = proc.communicate()
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            finally:  # also when a second signal cuts the grace short: then the child is killed at once
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def run_quickstart(run_dir: Path, sets: Iterable[str]) -> subprocess.CompletedProcess[str]:
    """The quickstart into ``run_dir`` with ``--set`` overrides, no live display, no config watching."""
    cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
           "--set", 'monitor.display="off"']
    for s in sets:
        cmd += ["--set", s]
    return run_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_logged(args: Sequence[str], sets: Iterable[str], log: Path) -> None:
    """``run.py ARGS`` with ``--set`` overrides and no live display, its output to ``log`` (a long run's output is
    kept on disk, not in memory); raises RuntimeError with the log's end when it fails."""
    cmd = [sys.executable, "run.py", *args, "--set", 'monitor.display="off"']
    for s in sets:
        cmd += ["--set", s]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        r = run_child(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run.py {' '.join(args)} exited {r.returncode}; log {log}:\n{tail}")
