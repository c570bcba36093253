"""Noticing at once that the policy engine is gone, not at the next weight push.

The processes bridle launched for the engine (one server; or several workers and the router in front of them) are
watched by their exit status: the moment one exits, :func:`watch_engine` raises :class:`EngineDied` naming it, with
its exit code and the end of its log, and the proxy actor's crash stops the run (exit code 1) before the scheduler
issues more rollouts into a dead engine. An engine bridle only attached to (a URL, and its workers; or servers a
launched router fronts) is watched by ``/health`` on the URL and every worker: ``failures`` probes in a row that
fail (each bounded by the client's connect timeout) end the run the same way. Runs without weight pushes (``--serve``, evaluation) rely on this alone.
"""

from __future__ import annotations

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
    procs = list(getattr(engine, "processes", ()))  # pipeline.serving.engine.EngineProcess
    if not procs and not hasattr(engine, "health"):
        await anyio.sleep_forever()
    missed = 0
    probe = not procs or getattr(engine, "watch_health", False)
    while True:
        await anyio.sleep(interval_s)
        for p in procs:
            code = p.process.poll()
            if code is not None:
                raise EngineDied(f"the {p.name} process (pid {p.process.pid}) exited with code {code}; the end "
                                 f"of its log {p.log_path}:\n{_tail(p.log_path)}")
        if not probe:
            continue
        if await engine.health():
            missed = 0
            continue
        missed += 1
        log.warning("engine health probe failed", missed=missed, of=failures)
        if missed >= failures:
            raise EngineDied(f"the engine at {getattr(engine, 'base_url', '?')} (or one of its workers) failed "
                             f"{missed} health probes in a row ({interval_s:g} s apart)")
