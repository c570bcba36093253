"""Where the learner runs: in this process (:class:`InProcess`, ``[learner] processes = 1``) or as N rank processes
started by Accelerate's launcher (:func:`start_ranks`, ``processes = N``). Both answer the same async calls
(``init``, ``train_step``, ``sft_step``, ``save_weights``, ``save_checkpoint``, ``load_checkpoint``), so the learner
actor does not care which.

The ranks: ``python -m accelerate.commands.launch --multi_gpu --num_processes N -m
pipeline.training.rank_worker`` (torchrun underneath; on a machine without CUDA, ``ACCELERATE_USE_CPU`` makes each
rank a CPU rank of a gloo process group). Each rank connects back over a Unix socket; commands and replies are
msgspec frames (an 8-byte length, then msgpack). Every command goes to every rank with the whole batch; each rank
trains its share (:meth:`pipeline.training.learner.Learner.train_step`), DDP all-reduces the gradients, rank 0
writes weights and checkpoints. A rank that answers with an error, closes its channel, or a launcher that exits
fails the call at once with the rank's traceback or the end of the ranks' log; a call that outlasts its timeout
fails too. The ranks are stopped (their process group killed) when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from pipeline.core.logs import get_logger
from pipeline.core.paths import REPO
from pipeline.core.runfiles import kill_marked, remove_prefixed
from pipeline.core.runtime import on_emergency
from pipeline.messages import TreeGroup
from pipeline.training.stage import StageSettings

T = TypeVar("T")

RANKS_MARKER = "BRIDLE_LEARNER_RANKS"  # in every rank's environment: the run's tag


# ------------------------------------------------------------------------------------------------- protocol
class Init(msgspec.Struct, tag=True, kw_only=True):
    """Build a fresh Learner from a HF folder (a new stage: SFT, RL after SFT, or the one to resume into)."""

    model: str
    config: StageSettings


class TrainStep(msgspec.Struct, tag=True):
    groups: list[TreeGroup]


class SftStep(msgspec.Struct, tag=True):
    groups: list[TreeGroup]


class SaveWeights(msgspec.Struct, tag=True):
    path: str
    version: int


class SaveCheckpoint(msgspec.Struct, tag=True):
    path: str
    extra: dict[str, Any]


class LoadCheckpoint(msgspec.Struct, tag=True):
    path: str


class Shutdown(msgspec.Struct, tag=True):
    pass


Command = Init | TrainStep | SftStep | SaveWeights | SaveCheckpoint | LoadCheckpoint | Shutdown


class Hello(msgspec.Struct, kw_only=True):
    """A rank's first frame: which it is."""

    rank: int
    ranks: int
    pid: int


class Reply(msgspec.Struct, kw_only=True):
    step: int = 0
    version: int = 0
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str = ""  # the rank's traceback


_HEADER = 8
_encoder = msgspec.msgpack.Encoder()


def frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return len(body).to_bytes(_HEADER, "big") + body


# ------------------------------------------------------------------------------------------------- in process
class InProcess:
    """``processes = 1``: the Learner in this process, its methods in a worker thread (the event loop stays free)."""

    def __init__(self) -> None:
        from pipeline.training.learner import Learner

        self._cls = Learner
        self.learner: Any = None

    @property
    def version(self) -> int:
        return self.learner.version

    async def init(self, model: Any, config: StageSettings, model_path: str | os.PathLike[str] | None = None) -> None:
        self.learner = None  # the old stage's model and optimizer go before the new ones are built
        self.learner = await anyio.to_thread.run_sync(lambda: self._cls(model, config, model_path=model_path))

    async def train_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        # abandon_on_cancel: Ctrl-C must not wait for a long step; its result is simply never published
        return await anyio.to_thread.run_sync(self.learner.train_step, groups, abandon_on_cancel=True)

    async def sft_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        return await anyio.to_thread.run_sync(self.learner.sft_step, groups, abandon_on_cancel=True)

    async def save_weights(self, path: Path, version: int) -> None:
        await anyio.to_thread.run_sync(self.learner.save_weights, path, version)

    async def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        await anyio.to_thread.run_sync(self.learner.save_checkpoint, path, extra)

    async def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(self.learner.load_checkpoint, path)

    async def policy_state(self) -> dict[str, Any]:
        """The policy's tensors by name, for weight sync without the disk (pipeline/serving/weight_sync.py)."""
        return await anyio.to_thread.run_sync(self.learner.policy_state)


# ------------------------------------------------------------------------------------------------- ranks
class RankError(RuntimeError):
    """A learner rank failed, died or did not answer in time; the message carries its traceback or log tail."""


class Ranks:
    """The client of N running ranks (made by :func:`start_ranks`)."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, timeout_s: float):
        self.proc = proc
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.streams: list[SocketStream] = []
        self.readers: list[BufferedByteReceiveStream] = []
        self.pids: list[int] = []  # of each rank
        self.version = 0
        self.step = 0

    @property
    def processes(self) -> int:
        return len(self.streams)

    async def init(self, model: Any, config: StageSettings, model_path: str | os.PathLike[str] | None = None) -> None:
        """``model``: a HF folder (each rank loads it; a module cannot cross processes), which also holds the
        tokenizer files: ``model_path`` is only :meth:`InProcess.init`'s."""
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"learner ranks load the model from a folder; got a {type(model).__name__}")
        await self._call(Init(model=str(model), config=config), "init")

    async def train_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        return (await self._call(TrainStep(groups), "train_step")).metrics

    async def sft_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        return (await self._call(SftStep(groups), "sft_step")).metrics

    async def save_weights(self, path: Path, version: int) -> None:
        await self._call(SaveWeights(str(path), version), "save_weights")

    async def save_checkpoint(self, path: Path, extra: dict[str, Any]) -> None:
        await self._call(SaveCheckpoint(str(path), extra), "save_checkpoint")

    async def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return (await self._call(LoadCheckpoint(str(path)), "load_checkpoint")).extra

    # --------------------------------------------------------------------------------------------- internals
    async def _call(self, cmd: Command, what: str, timeout_s: float | None = None) -> Reply:
        """Send ``cmd`` to every rank and wait for all replies (rank 0's is returned: the metrics are global)."""
        data = frame(cmd)
        replies: list[Reply | None] = [None] * self.processes

        async def all_ranks() -> Reply:
            failed: list[RankError] = []
            async with anyio.create_task_group() as tg:
                async def one(r: int) -> None:
                    try:
                        await self.streams[r].send(data)
                        reply = msgspec.msgpack.decode(await _read(self.readers[r]), type=Reply)
                    except _CLOSED:
                        failed.append(await self._died(f"learner rank {r} closed its channel during {what}"))
                        tg.cancel_scope.cancel()
                        return
                    if reply.error:
                        failed.append(RankError(f"learner rank {r} failed in {what}:\n{reply.error}"))
                        tg.cancel_scope.cancel()
                    replies[r] = reply

                for r in range(self.processes):
                    tg.start_soon(one, r)
            if failed:
                with anyio.move_on_after(3):  # a rank failing because a peer died: say so, with the log's end
                    while self.proc.poll() is None:  # noqa: ASYNC110 — a Popen's exit has no awaitable signal
                        await anyio.sleep(0.1)
                if self.proc.poll() is not None and "launcher exit code" not in str(failed[0]):
                    raise RankError(f"{failed[0]}\n(launcher exit code {self.proc.poll()}); log {self.log_path}:\n"
                                    f"{_tail(self.log_path)}")
                raise failed[0]
            return replies[0]  # type: ignore[return-value]

        reply = await self._guarded(what, timeout_s or self.timeout_s, all_ranks)
        self.step, self.version = reply.step, reply.version
        return reply

    async def _guarded(self, what: str, timeout_s: float, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``, failed at once when the launcher exits or a channel closes, and after ``timeout_s``."""
        result: list[T] = []
        error: list[BaseException] = []

        async with anyio.create_task_group() as tg:
            def fail(e: BaseException) -> None:
                error.append(e)
                tg.cancel_scope.cancel()

            async def main() -> None:
                try:
                    result.append(await work())
                except RankError as e:
                    fail(e)
                except _CLOSED:
                    fail(await self._died(f"a rank closed its channel during {what}"))
                else:
                    tg.cancel_scope.cancel()

            async def watch() -> None:
                while self.proc.poll() is None:  # noqa: ASYNC110 — a Popen's exit has no awaitable signal
                    await anyio.sleep(0.2)
                fail(await self._died(f"the learner ranks ended during {what}"))

            async def deadline() -> None:
                await anyio.sleep(timeout_s)
                fail(RankError(f"learner ranks did not finish {what} in {timeout_s:.0f}s "
                               f"([learner] rank_timeout_s); log {self.log_path}:\n{_tail(self.log_path)}"))

            tg.start_soon(main)
            tg.start_soon(watch)
            tg.start_soon(deadline)
        if error:
            raise error[0]
        return result[0]

    async def _died(self, what: str) -> RankError:
        # The launcher stops the other ranks when one fails; give it a moment so its exit code and the failing
        # rank's traceback are in the log we quote.
        with anyio.move_on_after(15):
            while self.proc.poll() is None:  # noqa: ASYNC110 — as in watch() above
                await anyio.sleep(0.1)
        code = self.proc.poll()
        return RankError(f"{what} (launcher exit code {code}); log {self.log_path}:\n{_tail(self.log_path)}")


# What reading or writing a rank's socket raises once the rank is gone.
_CLOSED = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


async def _read(reader: BufferedByteReceiveStream) -> bytes:
    n = int.from_bytes(await reader.receive_exactly(_HEADER), "big")
    return await reader.receive_exactly(n)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def launch_command(processes: int, socket_path: str, *, cuda: bool, gpus: str = "", fsdp: bool = False,
                   threads: int = 0) -> list[str]:
    """The ``accelerate launch`` command line of the ranks."""
    per_rank = threads or max(1, (os.cpu_count() or 1) // processes)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", "--monitor_interval", "0.5",  # 0: the launcher picks a free port
           "--num_cpu_threads_per_process", str(per_rank)]
    if fsdp:
        # Parameters, gradients and optimizer state sharded over the ranks, one unit per transformer layer; full
        # state dicts so weights and checkpoints stay plain HF folders.
        cmd += ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_auto_wrap_policy",
                "TRANSFORMER_BASED_WRAP", "--fsdp_state_dict_type", "FULL_STATE_DICT",
                "--fsdp_use_orig_params", "true", "--fsdp_sync_module_states", "true"]
    else:
        cmd += ["--multi_gpu"]  # Accelerate's torchrun launcher; on CPU each rank joins a gloo group
    if cuda and gpus:
        cmd += ["--gpu_ids", gpus]
    return cmd + ["-m", "pipeline.training.rank_worker", "--socket", socket_path, "--threads", str(threads)]


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _stop(proc: subprocess.Popen, grace_s: float = 10.0, exit_s: float = 0.0) -> None:
    """``exit_s``: how long the launcher may take to exit by itself (its ranks acknowledged a Shutdown) before it
    is sent SIGTERM; then ``grace_s`` before SIGKILL."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(exit_s)
    if proc.poll() is None:
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
    # torchrun's workers get sessions of their own: anything of the group left is killed too
    _kill_group(proc.pid)


@contextlib.asynccontextmanager
async def start_ranks(processes: int, *, log_path: Path, gpus: str = "", fsdp: bool = False, threads: int = 0,
                      timeout_s: float = 1800.0, start_timeout_s: float = 600.0,
                      socket_prefix: str = "bridle-ranks-", run: str = "") -> AsyncIterator[Ranks]:
    """Start ``processes`` learner ranks and wait until each has connected; stopped on exit (also when cancelled).
    ``gpus``: CUDA device ids for the ranks ("0,1"; empty: all visible); without CUDA the ranks run on the CPU.
    ``socket_prefix``: of the socket's folder in the temp dir; what a crash left under it is removed first.
    ``run``: the run's tag, in every rank's environment (``BRIDLE_LEARNER_RANKS``): ranks an earlier start of this
    run left running after a ``kill -9`` (they stop only when they next read their closed channel, a step later)
    are killed first, so they never train beside the new ones."""
    import torch

    cuda = torch.cuda.is_available()
    if fsdp and not cuda:
        raise ValueError("[learner] fsdp = true needs CUDA devices: Accelerate's FSDP plugin does not shard over CPU "
                         "ranks (set fsdp = false to train the ranks with DDP)")
    log = get_logger(actor="learner")
    remove_prefixed(tempfile.gettempdir(), socket_prefix)
    if run and (n := await anyio.to_thread.run_sync(kill_marked, f"{RANKS_MARKER}={run}")):
        log.warning("killed learner ranks an earlier start of this run left running", processes=n)
    sock_dir = Path(tempfile.mkdtemp(prefix=socket_prefix))  # not the run folder: a socket path has < 108 bytes
    sock_path = sock_dir / "learner.sock"
    cmd = launch_command(processes, str(sock_path), cuda=cuda, gpus=gpus, fsdp=fsdp, threads=threads)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if run:
        env[RANKS_MARKER] = run
    if not cuda:
        env["ACCELERATE_USE_CPU"] = "true"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    listener = await anyio.create_unix_listener(sock_path)

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as logf:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env, cwd=REPO)

    proc = await anyio.to_thread.run_sync(spawn)
    unregister = on_emergency(lambda: _kill_group(proc.pid))
    log.info("learner ranks starting", processes=processes, pid=proc.pid, log=str(log_path), cmd=" ".join(cmd))
    ranks = Ranks(proc, log_path, timeout_s)
    shut_down = False
    t0 = time.monotonic()
    try:
        async def accept_all() -> None:
            by_rank: dict[int, tuple[SocketStream, BufferedByteReceiveStream, int]] = {}
            while len(by_rank) < processes:
                stream = await listener.accept()
                reader = BufferedByteReceiveStream(stream)
                hello = msgspec.msgpack.decode(await _read(reader), type=Hello)
                if hello.ranks != processes:
                    raise RankError(f"learner rank {hello.rank} sees {hello.ranks} processes, not {processes}: "
                                    f"the launcher did not start a process group of the asked size")
                by_rank[hello.rank] = (stream, reader, hello.pid)
            ranks.streams = [by_rank[r][0] for r in range(processes)]
            ranks.readers = [by_rank[r][1] for r in range(processes)]
            ranks.pids = [by_rank[r][2] for r in range(processes)]

        await ranks._guarded("start-up", start_timeout_s, accept_all)
        log.info("learner ranks connected", processes=processes, seconds=round(time.monotonic() - t0, 1))
        yield ranks
        with contextlib.suppress(RankError):  # the ranks are stopped below either way
            await ranks._call(Shutdown(), "shutdown", timeout_s=30)
            shut_down = True
    finally:
        with anyio.CancelScope(shield=True):
            for s in ranks.streams:
                await s.aclose()
            await listener.aclose()
            await anyio.to_thread.run_sync(partial(_stop, proc, exit_s=15.0 if shut_down else 0.0))
            unregister()
            shutil.rmtree(sock_dir, ignore_errors=True)
        log.info("learner ranks stopped", returncode=proc.returncode)
