"""Noticing at once that the policy engine is gone, not at the next weight push.

An engine process bridle launched is watched by its exit status: the moment it exits, :func:`watch_engine` raises
:class:`EngineDied` with the exit code and the end of the engine's log, and the proxy actor's crash stops the run
(exit code 1) before the scheduler issues more rollouts into a dead engine. An engine bridle only attached to (a
URL) is watched by ``/health``: ``failures`` probes in a row that fail (each bounded by the client's connect
timeout) end the run the same way. Runs without weight pushes (``--serve``, evaluation) rely on this alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import anyio

from pipeline.core.logs import get_logger

log = get_logger(component="engine_watchdog")
TAIL_CHARS = 3000


class EngineDied(RuntimeError):
    """The engine process exited, or an attached engine stopped answering /health."""


def _tail(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text[-TAIL_CHARS:]


async def watch_engine(engine: Any, *, interval_s: float = 0.5, failures: int = 3) -> None:
    """Return only by cancellation; raise EngineDied when the engine is gone. Engines with neither a process nor
    a ``health`` probe (the in-process scripted engine) cannot die apart from the run, and are not watched."""
    proc: subprocess.Popen | None = getattr(engine, "process", None)
    log_path: Path | None = getattr(engine, "log_path", None)
    if proc is None and not hasattr(engine, "health"):
        await anyio.sleep_forever()
    missed = 0
    while True:
        await anyio.sleep(interval_s)
        if proc is not None:
            code = proc.poll()
            if code is not None:
                raise EngineDied(f"the engine process (pid {proc.pid}) exited with code {code}; the end of its "
                                 f"log {log_path}:\n{_tail(log_path)}")
            continue
        if await engine.health():
            missed = 0
            continue
        missed += 1
        log.warning("engine health probe failed", missed=missed, of=failures)
        if missed >= failures:
            raise EngineDied(f"the engine at {getattr(engine, 'base_url', '?')} failed {missed} health probes in a "
                             f"row ({interval_s:g} s apart)")
