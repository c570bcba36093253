"""Sandboxes started ahead of demand, and a host-wide bound on how fast sandboxes are created.

:class:`WarmPool` keeps up to ``[sandbox] warm`` started sandboxes per key (a backend's key says which sandboxes are
interchangeable: for Docker the task's image, the harness, the proxy socket and the limits). A pooled sandbox runs
:data:`WAIT_EXEC`, bridle's few lines of Python that wait for the rollout's launch (argv and environment, written to
its ``go/go.json`` by the backend) and then become the harness: everything that does not depend on the task is done
ahead (Docker: container created and started, forwarder listening, image workspace copied, limits applied; local:
the process, its rlimits and PID namespace), everything that does (the task's files, the rollout token, the
instruction) only when a rollout takes it. Each sandbox serves exactly one rollout and is destroyed by that rollout's
cleanup, as a cold one is: no state crosses rollouts. A sandbox is handed out only after the backend's liveness check;
a dead one is destroyed and replaced. :meth:`WarmPool.keep_warm` refills in the background (the owner runs it in its
task group); :meth:`WarmPool.aclose` destroys what is still pooled; pooled sandboxes carry the run's tag, so a restart
after ``kill -9`` reaps them with the rest of the run.

:class:`CreationGate` bounds sandbox creations on the host (``[sandbox] creations_per_s``,
``creations_at_once``) across every bridle process of this user, through ``flock`` on files in the temp dir: a
provider or engine that throttles creations (Modal's 5/s) or stalls under a burst of them is never asked faster.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio

from pipeline.core.logs import get_logger

log = get_logger(component="sandbox")

GO_FILE = "go.json"  # in a pooled sandbox's go/ folder: {"argv": [...], "env": {...}}, written once, atomically
# Run as ``python3 -S -c WAIT_EXEC <go folder>``: wait for go.json, then become its argv with its env added.
WAIT_EXEC = (
    "import json,os,sys,time\n"
    f"p=os.path.join(sys.argv[1],{GO_FILE!r})\n"
    "while not os.path.exists(p):time.sleep(0.02)\n"
    "g=json.load(open(p))\n"
    "e=dict(os.environ);e.update(g['env'])\n"
    "os.execvpe(g['argv'][0],g['argv'],e)\n"
)
IDLE_KEY_S = 300.0  # a key no rollout asked for in this long is forgotten, its pooled sandboxes destroyed
RETRY_S = 5.0  # after a failed creation, the pool waits this long before it tries that key again

E = TypeVar("E")


def write_go(folder: Path, argv: list[str], env: dict[str, str]) -> None:
    """Hand a pooled sandbox its launch: go.json appears whole (written aside, then renamed) or not at all."""
    import json

    tmp = folder / f".{GO_FILE}.tmp"
    tmp.write_text(json.dumps({"argv": argv, "env": env}), encoding="utf-8")
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / GO_FILE)


@dataclass
class _Demand(Generic[E]):
    template: Any  # what the backend needs to make one more (the first taker's)
    ready: deque[E] = field(default_factory=deque)
    making: int = 0
    last_asked: float = 0.0
    failed_at: float = 0.0


class WarmPool(Generic[E]):
    """Up to ``size`` ready sandboxes per key (see the module docstring). ``make(key, template)`` creates and starts
    one (it cleans up after itself when it fails or is cancelled), ``alive(entry)`` checks one before hand-out,
    ``destroy(entry)`` removes one that is never handed out."""

    def __init__(self, size: int, *, make: Callable[[Hashable, Any], Awaitable[E]],
                 alive: Callable[[E], Awaitable[bool]], destroy: Callable[[E], Awaitable[None]],
                 idle_key_s: float = IDLE_KEY_S):
        self.size = size
        self._make, self._alive, self._destroy = make, alive, destroy
        self.idle_key_s = idle_key_s
        self._keys: dict[Hashable, _Demand[E]] = {}
        self._wake = anyio.Event()
        self._closed = False
        # hits: handed out warm; misses: none ready, the rollout made its own; dead: found dead, replaced;
        # made / failed: creations by the pool
        self.counts: Counter[str] = Counter()

    @property
    def ready(self) -> int:
        return sum(len(d.ready) for d in self._keys.values())

    async def take(self, key: Hashable, template: Any) -> E | None:
        """A live pooled sandbox for ``key`` (now the caller's to run and destroy), or None when none is ready;
        either way the pool then refills ``key`` in the background."""
        d = self._keys.get(key)
        if d is None:
            d = self._keys[key] = _Demand(template)
        d.last_asked = time.monotonic()
        found: E | None = None
        while d.ready and found is None:
            entry = d.ready.popleft()
            if await self._alive(entry):
                found = entry
            else:
                self.counts["dead"] += 1
                log.warning("warm_sandbox_dead", key=str(key)[:120])
                await self._destroy(entry)
        self.counts["hits" if found is not None else "misses"] += 1
        self._wake.set()
        return found

    async def keep_warm(self) -> None:
        """Refill every key to ``size``, forever (run it in the owner's task group; cancel it before aclose)."""
        if self.size <= 0:
            return
        while not self._closed:
            await self._expire()
            todo = [(k, d) for k, d in self._keys.items()
                    if len(d.ready) + d.making < self.size and time.monotonic() - d.failed_at >= RETRY_S]
            if not todo:
                self._wake = anyio.Event()
                with anyio.move_on_after(RETRY_S):  # also wakes to expire idle keys and retry failed ones
                    await self._wake.wait()
                continue
            for key, d in todo:
                await self._one(key, d)

    async def _one(self, key: Hashable, d: _Demand[E]) -> None:
        d.making += 1
        try:
            entry = await self._make(key, d.template)
        except Exception as e:  # noqa: BLE001 - a failed warm start costs only the warmth; the rollout makes its own
            d.failed_at = time.monotonic()
            self.counts["failed"] += 1
            log.warning("warm_sandbox_failed", key=str(key)[:120], error=f"{type(e).__name__}: {e}"[:400])
            return
        finally:
            d.making -= 1
        self.counts["made"] += 1
        if self._closed or self._keys.get(key) is not d:
            await self._destroy(entry)
        else:
            d.ready.append(entry)

    async def _expire(self) -> None:
        now = time.monotonic()
        for key, d in list(self._keys.items()):
            if now - d.last_asked > self.idle_key_s and not d.making:
                del self._keys[key]
                while d.ready:
                    await self._destroy(d.ready.popleft())

    async def aclose(self) -> None:
        """Destroy every pooled sandbox (shielded: a stop must not leave them)."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for d in self._keys.values():
                while d.ready:
                    await self._destroy(d.ready.popleft())
            self._keys.clear()

    def metrics(self) -> dict[str, float]:
        return {"warm_ready": float(self.ready), **{f"warm_{k}": float(v) for k, v in self.counts.items()}}


class CreationGate:
    """At most ``per_s`` sandbox creations a second and ``at_once`` under way, on this host, over every bridle
    process of this user (0: no bound). Waiting is counted: ``created``, ``waited_s``."""

    def __init__(self, per_s: float = 0.0, at_once: int = 0, *, folder: Path | None = None):
        self.per_s, self.at_once = per_s, at_once
        self.folder = folder or Path(tempfile.gettempdir()) / f"bridle-creations-{os.getuid()}"
        self.created = 0
        self.waited_s = 0.0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one creation's place for the ``async with`` body (the engine call that creates and starts)."""
        t0 = time.monotonic()
        fd = await self._take_place() if self.at_once > 0 else None
        try:
            if self.per_s > 0:
                await self._take_turn()
            self.waited_s += time.monotonic() - t0
            self.created += 1
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases its flock

    async def _take_place(self) -> int:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:
            for i in range(self.at_once):
                fd = os.open(self.folder / f"place-{i}", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    os.close(fd)
            await anyio.sleep(0.01)

    async def _take_turn(self) -> None:
        """Book the next free turn in the host-wide schedule (a timestamp in one locked file), then sleep until it."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.folder / "turns", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await anyio.sleep(0.002)
            now = time.time()
            last = 0.0
            with suppress(ValueError):
                last = float(os.pread(fd, 64, 0).decode() or 0)
            turn = max(now, last + 1.0 / self.per_s)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{turn:.6f}".encode(), 0)
        finally:
            os.close(fd)
        await anyio.sleep(max(0.0, turn - time.time()))

    def metrics(self) -> dict[str, float]:
        return {"sandboxes_created": float(self.created), "creation_wait_s": self.waited_s}
