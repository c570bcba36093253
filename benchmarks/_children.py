"""Child processes for the benchmarks: marker lines read from their stdout, their CPU time read from /proc."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Child:
    """A child process whose stdout we read line by line for marker lines."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, stdin: bool = False,
                 log_dir: Path | None = None) -> None:
        self.name = name
        self.log_path = (log_dir / f"{name}.stderr.log") if log_dir else None
        with open(self.log_path or os.devnull, "wb") as err:  # the child keeps its own copy of the handle
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, cwd=str(ROOT), text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"{self.name}: no '{marker.strip()}' line within {timeout:.0f} s "
                                   f"(exit code {self.proc.poll()}; stderr in {self.log_path})")
            if line.startswith(marker):
                return line[len(marker):].strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                else:
                    self.proc.terminate()
                self.proc.wait(timeout=grace)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()


def _proc_stat(path: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) from a /proc .../stat file; None when it is gone."""
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()  # fields after "pid (comm)"
    return int(f[1]), (int(f[11]) + int(f[12])) / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (Linux /proc; NaN elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return float("nan")
    stats = {int(e): st for e in entries if e.isdigit() and (st := _proc_stat(f"/proc/{e}/stat")) is not None}
    if pid not in stats:
        return float("nan")
    total, todo = 0.0, [pid]
    while todo:
        q = todo.pop()
        total += stats[q][1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == q]
    return total


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process's main thread: bridle's event loop, without its tokenizer threads."""
    st = _proc_stat(f"/proc/{pid}/task/{pid}/stat")
    return st[1] if st is not None else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
