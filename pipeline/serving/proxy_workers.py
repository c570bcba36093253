"""Proxy workers (``[proxy] workers = N``): N proxy processes, each owning the rollouts routed to it.

One event loop serves ≈1,000 fresh 2k-token calls per second at best, whatever the cores (docs/serving.md,
"Proxy workers"); past that the proxy runs as several processes. The proxy actor keeps the engine, the routing and
the weight pushes; each worker is a :class:`pipeline.serving.proxy.Proxy` in its own process, with its own TCP port
and Unix socket, its own client to the same engine and the splicer state of its rollouts. A rollout goes to the
worker with the fewest live rollouts; the RolloutRequest the sandbox pool gets names that worker
(``RolloutRequest.proxy``), so the harness talks to its worker directly and nothing relays its calls.

Control channel: one Unix socket (the actor listens, every worker connects) carrying frames: a u32 little-endian
length, then a msgpack payload of one of the tagged structs below (the call records are the messages themselves)::

    worker -> actor   Hello, Ready (once each), Registered, CallStarted / ModelCall / CallFailed
    actor -> worker   Setup (once), Register, Forget, Version, Reconfigure

A worker acknowledges a Register before the actor forwards the rollout, so no harness reaches a worker that does
not know its token yet. A worker that exits, or closes the channel, fails the run with the tail of its log; closing
the channel is how the actor stops them (then the process group is terminated, as for an engine).

``python -m pipeline.serving.proxy_workers --control SOCK --worker I`` is the worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import anyio
import msgspec
from anyio.abc import TaskStatus

from pipeline.core.logs import configure, get_logger
from pipeline.core.runtime import run_main
from pipeline.messages import CallFailed, CallStarted, Message, ModelCall, ProxyEndpoint, RolloutRequest
from pipeline.serving.engine import EngineProcess
from pipeline.serving.factory import EngineSettings, open_renderer
from pipeline.serving.launch import process
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.sglang_client import HttpEngine

log = get_logger(actor="proxy_workers")

_LEN = struct.Struct("<I")
READER_GRACE_S = 10.0  # a channel found gone is left this long to the watch that reports its worker (ProxyWorkers)
MAX_FRAME = 1 << 30  # a ModelCall of a 32k context is ~0.3 MB; anything near this is a broken stream


class _Frame(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of the control frames; ``type`` (the class name) is the tag, as for the messages."""


class Hello(_Frame):
    worker: int
    pid: int


class Setup(_Frame):
    proxy: ProxySettings  # this worker's: its own port and Unix socket
    renderer: EngineSettings  # the renderer fields are read (the engine itself is the actor's)
    engine_url: str
    control_urls: list[str]
    generate_timeout_s: float
    policy_version: int
    log_level: str = "info"


class Ready(_Frame):
    base_url: str
    unix_socket: str = ""


class Register(_Frame):
    request: RolloutRequest


class Registered(_Frame):
    rollout_id: str


class Forget(_Frame):
    rollout_id: str


class Version(_Frame):
    version: int


class Reconfigure(_Frame):
    proxy: ProxySettings


ToWorker = Union[Setup, Register, Forget, Version, Reconfigure]  # noqa: UP007 — a union of tagged types, read as a list
FromWorker = Union[Hello, Ready, Registered, CallStarted, ModelCall, CallFailed]  # noqa: UP007

_ENC = msgspec.msgpack.Encoder()
TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)


class FrameError(Exception):
    """The control channel carried something that is not a frame."""


class WorkerDied(RuntimeError):
    """A proxy worker exited or dropped its control channel while the run needed it."""


def encode_frame(msg: Any) -> bytearray:
    buf = bytearray(_LEN.size)
    _ENC.encode_into(msg, buf, _LEN.size)
    _LEN.pack_into(buf, 0, len(buf) - _LEN.size)
    return buf


async def read_frame(receive_exactly: Callable[[int], Awaitable[bytes]], decoder: msgspec.msgpack.Decoder) -> Any:
    """One frame from a stream's ``readexactly`` (asyncio) or ``receive_exactly`` (anyio)."""
    (n,) = _LEN.unpack(await receive_exactly(_LEN.size))
    if n > MAX_FRAME:
        raise FrameError(f"a frame of {n} bytes (at most {MAX_FRAME}): the stream is out of step")
    try:
        return decoder.decode(await receive_exactly(n))
    except msgspec.DecodeError as e:
        raise FrameError(f"undecodable frame: {e}") from None


def worker_endpoint(settings: ProxySettings, index: int) -> ProxySettings:
    """Worker ``index``'s settings: its own port (``port + index`` when a port is set) and Unix socket."""
    sock = settings.unix_socket
    if sock and sock != "auto":  # "auto": each worker's proxy makes its own
        root, ext = os.path.splitext(sock)
        sock = f"{root}-{index}{ext}"
    return msgspec.structs.replace(settings, port=settings.port + index if settings.port else 0, unix_socket=sock)


@dataclass(eq=False)
class _Worker:
    index: int
    settings: ProxySettings
    log_path: Path
    pid: int = 0
    process: EngineProcess | None = None
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    endpoint: ProxyEndpoint | None = None
    rollouts: set[str] = field(default_factory=set)
    calls: int = 0


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ProxyWorkers:
    """The actor's side: start the workers (:meth:`run`), route rollouts to them, pass on what they record."""

    def __init__(self, n: int, settings: ProxySettings, setup: Setup, emit: Callable[[Message], Awaitable[None]], *,
                 control_dir: str, log_dir: Path, start_timeout_s: float = 120.0, ack_timeout_s: float = 30.0):
        self.setup = setup
        self.emit = emit
        self.control = os.path.join(control_dir, "control.sock")
        self.workers = [_Worker(i, worker_endpoint(settings, i), log_dir / f"proxy-worker-{i}.log") for i in range(n)]
        self.start_timeout_s = start_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.owner: dict[str, _Worker] = {}  # rollout id -> its worker
        self._acks: dict[str, anyio.Event] = {}
        self._closing = False

    # ------------------------------------------------------------------------------------------ routing
    async def register(self, req: RolloutRequest) -> RolloutRequest:
        """Give the rollout to the least busy worker; returns the request naming that worker, once it knows it."""
        w = min(self.workers, key=lambda w: (len(w.rollouts), w.index))
        self.owner[req.rollout_id] = w
        w.rollouts.add(req.rollout_id)
        ev = self._acks[req.rollout_id] = anyio.Event()
        await self._send(w, Register(request=req))
        with anyio.move_on_after(self.ack_timeout_s):
            await ev.wait()
        if not ev.is_set():
            self._acks.pop(req.rollout_id, None)
            raise WorkerDied(f"proxy worker {w.index} did not acknowledge rollout {req.rollout_id} within "
                             f"{self.ack_timeout_s:.0f}s; log {w.log_path}:\n{_tail(w.log_path)}")
        return msgspec.structs.replace(req, proxy=w.endpoint)

    async def forget(self, rollout_id: str) -> None:
        """The owner stops accepting the token and aborts the rollout's calls still in flight."""
        w = self.owner.pop(rollout_id, None)
        if w is not None:
            w.rollouts.discard(rollout_id)
            await self._send(w, Forget(rollout_id=rollout_id))

    async def set_version(self, version: int) -> None:
        for w in self.workers:
            await self._send(w, Version(version=version))

    async def reconfigure(self, **changes: Any) -> None:
        for w in self.workers:
            w.settings = msgspec.structs.replace(w.settings, **changes)
            await self._send(w, Reconfigure(proxy=w.settings))

    @property
    def endpoint(self) -> ProxyEndpoint:
        """Worker 0's address, for ServiceReady (a rollout is always sent to its own worker's)."""
        assert self.workers[0].endpoint is not None
        return self.workers[0].endpoint

    async def _send(self, w: _Worker, msg: Any) -> None:
        assert w.writer is not None
        try:
            if not self._closing:
                w.writer.write(encode_frame(msg))  # whole, so frames never interleave
                with anyio.fail_after(self.ack_timeout_s):
                    await w.writer.drain()
                return
        except (ConnectionError, TimeoutError) as e:
            if isinstance(e, ConnectionError) and not self._closing:
                await self._leave_it_to_the_watch()
            if not self._closing:
                raise self._died(w, f"its control channel failed ({e!r})") from None
        # The workers are being stopped (the run is stopping, or one died and :meth:`run` is about to raise): that
        # ends the caller too, with one error for the run rather than one per channel.
        await anyio.sleep_forever()

    async def _leave_it_to_the_watch(self) -> None:
        """A channel found gone: its worker's reader (or, while they start, :meth:`_watch_start`) sees it too and
        reports the worker with its exit code. Left to it, the run fails with one error; raised here as well, the
        crash named only "unhandled errors in a TaskGroup (2 sub-exceptions)", or an IncompleteReadError during a
        handshake. The caller reports it itself if nothing has within :data:`READER_GRACE_S`."""
        await anyio.sleep(READER_GRACE_S)

    def _died(self, w: _Worker, what: str) -> WorkerDied:
        return WorkerDied(f"proxy worker {w.index}: {what}; log {w.log_path}:\n{_tail(w.log_path)}")

    # --------------------------------------------------------------------------------------- lifecycle
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every worker, report started once all are serving, then pass their records on until cancelled
        (the workers are stopped then); raises :class:`WorkerDied` when one dies."""
        async with contextlib.AsyncExitStack() as stack:
            # asyncio streams, not anyio's: the relay reads two frames per call, and anyio's buffered stream costs
            # ~3x the CPU per frame (a checkpoint per receive); every proxy runs on asyncio anyway (aiohttp)
            conns: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
            server = await asyncio.start_unix_server(lambda r, w: conns.put_nowait((r, w)), self.control)
            stack.callback(server.close)
            for w in self.workers:
                cmd = [sys.executable, "-m", "pipeline.serving.proxy_workers", "--control", self.control,
                       "--worker", str(w.index)]
                w.process = await stack.enter_async_context(process(f"proxy-worker-{w.index}", cmd,
                                                                    log_path=w.log_path, actor="proxy_workers"))
            # runs last on the way out: the workers see their channel close and stop on their own (logging what
            # they served) before process() terminates what is left
            stack.push_async_callback(self._close)
            async with anyio.create_task_group() as tg:
                # until every worker is connected, a worker that exits is noticed here; from then on by its reader
                # (the channel closes with the process), which alone reports it, so the run fails with one error
                starting = anyio.CancelScope()
                tg.start_soon(self._watch_start, starting)
                with anyio.fail_after(self.start_timeout_s):
                    for _ in self.workers:
                        await self._handshake(*await conns.get())
                starting.cancel()
                log.info("proxy workers serving", workers=[w.endpoint.base_url for w in self.workers if w.endpoint])
                for w in self.workers:
                    tg.start_soon(self._read, w)
                task_status.started()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await read_frame(reader.readexactly, FROM_WORKER)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            await self._leave_it_to_the_watch()
            raise WorkerDied(f"a proxy worker closed its control channel before saying which it is "
                             f"({type(e).__name__})") from None
        if not isinstance(hello, Hello) or not 0 <= hello.worker < len(self.workers):
            raise FrameError(f"expected Hello from a worker, got {hello!r}")
        w = self.workers[hello.worker]
        w.reader, w.writer, w.pid = reader, writer, hello.pid
        await self._send(w, msgspec.structs.replace(self.setup, proxy=w.settings))
        try:
            ready = await read_frame(reader.readexactly, FROM_WORKER)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            await self._leave_it_to_the_watch()
            raise self._died(w, f"closed its control channel in its handshake ({type(e).__name__})") from None
        if not isinstance(ready, Ready):
            raise FrameError(f"expected Ready from proxy worker {w.index}, got {ready!r}")
        w.endpoint = ProxyEndpoint(worker=w.index, base_url=ready.base_url, unix_socket=ready.unix_socket)

    async def _read(self, w: _Worker) -> None:
        assert w.reader is not None
        while True:
            try:
                msg = await read_frame(w.reader.readexactly, FROM_WORKER)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if self._closing:
                    return
                if w.process is not None:
                    # the exit code and the last lines of its log, when it is dying
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await anyio.to_thread.run_sync(w.process.process.wait, 2.0)
                    if w.process.process.returncode is not None:
                        raise self._died(w, f"exited with code {w.process.process.returncode}") from None
                raise self._died(w, f"closed its control channel ({type(e).__name__})") from None
            if isinstance(msg, Registered):
                ev = self._acks.pop(msg.rollout_id, None)
                if ev is not None:
                    ev.set()
            else:
                if isinstance(msg, ModelCall):
                    w.calls += 1
                await self.emit(msg)

    async def _watch_start(self, scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                for w in self.workers:
                    if w.process is not None and w.process.process.poll() is not None:
                        raise self._died(w, f"exited with code {w.process.process.returncode}")
                await anyio.sleep(0.2)

    async def _close(self) -> None:
        self._closing = True
        with anyio.CancelScope(shield=True):
            for w in self.workers:
                if w.writer is not None:
                    w.writer.close()
            deadline = time.monotonic() + 5
            for w in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if w.process is not None:
                        await anyio.to_thread.run_sync(w.process.process.wait, max(0.0, deadline - time.monotonic()))
        log.info("proxy workers stopped", calls=[w.calls for w in self.workers])


# ------------------------------------------------------------------------------------------- the worker
async def worker_main(control: str, index: int) -> None:
    async with asyncio.timeout(30):
        reader, writer = await asyncio.open_unix_connection(control)
    calls = 0

    async def send(msg: Any) -> None:
        writer.write(encode_frame(msg))
        await writer.drain()

    async def emit(msg: Message) -> None:
        nonlocal calls
        calls += isinstance(msg, ModelCall)
        await send(msg)

    await send(Hello(worker=index, pid=os.getpid()))
    async with asyncio.timeout(60):
        setup = await read_frame(reader.readexactly, TO_WORKER)
    if not isinstance(setup, Setup):
        raise FrameError(f"expected Setup, got {setup!r}")
    configure(level=setup.log_level)
    wlog = get_logger(actor=f"proxy-worker-{index}")
    engine = HttpEngine(setup.engine_url, control_urls=setup.control_urls, timeout_s=setup.generate_timeout_s)
    proxy = Proxy(engine, open_renderer(setup.renderer), emit, setup.proxy)
    proxy.policy_version = setup.policy_version
    proxy.log = wlog
    async with asyncio.timeout(60):
        await proxy.start()
    try:
        await send(Ready(base_url=proxy.base_url, unix_socket=proxy.unix_socket))
        while True:
            try:
                msg = await read_frame(reader.readexactly, TO_WORKER)
            except asyncio.IncompleteReadError:
                break  # the actor closed the channel: the run is ending
            if isinstance(msg, Register):
                proxy.register(msg.request)
                await send(Registered(rollout_id=msg.request.rollout_id))
            elif isinstance(msg, Forget):
                for eng, rid in proxy.forget(msg.rollout_id):
                    try:
                        async with asyncio.timeout(5):
                            await eng.abort(rid)  # stragglers of a rollout settled by timeout
                    except TimeoutError:
                        wlog.warning("abort timed out", rid=rid)
            elif isinstance(msg, Version):
                proxy.policy_version = msg.version
            elif isinstance(msg, Reconfigure):
                proxy.settings = msg.proxy
    finally:
        await proxy.stop()
        await engine.aclose()
        wlog.info("proxy worker stopped", worker=index, calls=calls, rollouts=len(proxy.rollouts))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.serving.proxy_workers",
                                description="one proxy worker (started by the proxy actor)")
    p.add_argument("--control", required=True, help="the actor's control socket")
    p.add_argument("--worker", type=int, required=True)
    args = p.parse_args(argv)
    configure()
    run_main(worker_main, args.control, args.worker)


if __name__ == "__main__":
    main()
