"""Actor runtime: actors, bounded channels, and the supervisor that runs a graph of them.

- An :class:`Actor` has one ``run()`` loop, an inbox (one bounded stream, fed by every edge that points at it),
  named outputs, a structlog logger bound with its name, and a typed config section. ``on_config`` is the hook
  for hot reload.
- Channels are anyio memory object streams with a fixed ``max_buffer_size``: a full inbox blocks the sender,
  which is the back-pressure that keeps memory flat when a downstream actor is slower.
- The :class:`Supervisor` wires actors from an :class:`~pipeline.core.config.Experiment`, taps every sent message into
  the event log, runs everything in one task group, and stops the graph cleanly on SIGINT/SIGTERM or when an
  actor crashes (the crash is logged, recorded, and re-raised as :class:`ActorCrashed`).
- When an actor's ``run`` returns, its outputs close; a downstream inbox ends when all its senders closed, so a
  finite graph drains and stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.core import config as cfg
from pipeline.core.eventlog import AsyncEventLog
from pipeline.core.logs import get_logger
from pipeline.messages import ActorStopped, ConfigChanged, Message

C = TypeVar("C", bound=cfg.Section)


class Output:
    """A named output: records each message once in the event log, then sends it to every connected inbox."""

    def __init__(self, src: str, log: AsyncEventLog | None) -> None:
        self.src = src
        self._log = log
        self._sinks: list[MemoryObjectSendStream[Message]] = []
        self.sent = 0

    def connect(self, stream: MemoryObjectSendStream[Message]) -> None:
        self._sinks.append(stream)

    @property
    def connected(self) -> bool:
        return bool(self._sinks)

    async def send(self, msg: Message) -> None:
        if self._log is not None:
            await self._log.record(self.src, msg)
        self.sent += 1
        for s in list(self._sinks):
            try:
                await s.send(msg)
            except anyio.BrokenResourceError:
                # The receiving actor finished; it wants nothing more. Keep feeding the others. Several tasks of
                # one actor may send concurrently and find the same closed receiver: drop it once.
                if s in self._sinks:
                    get_logger(output=self.src).info("receiver finished; dropping this edge")
                    self._sinks.remove(s)

    async def aclose(self) -> None:
        for s in self._sinks:
            await s.aclose()
        self._sinks.clear()


@dataclass
class Resume:
    """What a resumed run continues from: the last learner checkpoint and how many RL steps it holds."""

    checkpoint: Path
    steps_done: int
    attempt: int = 1  # 1 for the first resume of a run, 2 for the second, ...: re-issued work gets new ids
    # Whether the event log holds the update record of the checkpoint's step (False: killed between the checkpoint
    # and the announcement; the learner writes it from the checkpoint)
    announced: bool = True
    metrics_recorded: bool = True  # and its metrics row
    # Killed inside the cold start: the SFT updates its checkpoint holds, and the demonstration packs the event log
    # recorded (TreeGroup / GroupDropped of purpose "sft"); None: the checkpoint is an RL step's.
    sft_updates: int | None = None
    sft_packs: list[Any] = field(default_factory=list)


@dataclass
class ActorContext:
    """What every actor is handed at construction besides its own section."""

    run_dir: Path | None = None  # the run's directory (weights, workspaces, engine logs)
    resume: Resume | None = None  # set when the run continues from a checkpoint (run.py --resume)
    run: cfg.RunSection = field(default_factory=cfg.RunSection)  # [run], kept current on hot reload


class Actor(Generic[C]):
    """Base class. Subclasses set ``Config`` and ``outputs`` and implement ``run``."""

    Config: ClassVar[type[cfg.Section]] = cfg.Section
    outputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, config: C, ctx: ActorContext | None = None) -> None:
        self.name = name
        self.config: C = config
        self.ctx = ctx if ctx is not None else ActorContext()
        self.inbox: MemoryObjectReceiveStream[Message] | None = None
        self.out: dict[str, Output] = {}
        self.log = get_logger(actor=name)

    @property
    def run_dir(self) -> Path | None:
        return self.ctx.run_dir

    @property
    def resume(self) -> Resume | None:
        return self.ctx.resume

    async def run(self) -> None:
        raise NotImplementedError

    async def on_config(self, new: C, changes: dict[str, Any]) -> None:
        """Called with a validated config whose changed fields are all reloadable. Override to react."""
        self.config = new

    async def on_run_config(self, new: cfg.RunSection, changes: dict[str, Any]) -> None:
        """Called on every actor when reloadable fields of ``[run]`` change; ``self.ctx.run`` is already ``new``.
        Override to react (most actors just read ``self.ctx.run`` when they need it)."""

    async def on_reload(self, change: ConfigChanged) -> None:
        """Called on every actor for each hot reload, applied or refused (the monitor records it); before the
        changed actors' ``on_config``."""

    async def send(self, output: str, msg: Message) -> None:
        await self.out[output].send(msg)

    def messages(self) -> MemoryObjectReceiveStream[Message]:
        """The inbox, for ``async for msg in self.messages()``; an actor with no incoming edge has none."""
        if self.inbox is None:
            raise RuntimeError(f"actor {self.name!r} has no incoming edge in [graph].edges")
        return self.inbox


# ------------------------------------------------------------------------------------------- hard exit
# What must not outlive the process even when it exits without cleanup: launchers and sandbox backends register a
# synchronous kill here (process groups, containers) while what they started runs.
_EMERGENCY: dict[int, Callable[[], None]] = {}


EVENT_LOOP_ENV = "BRIDLE_EVENT_LOOP"


def use_uvloop() -> bool:
    """Whether bridle's processes run on uvloop (the default where it is installed) or on asyncio's own loop
    (``BRIDLE_EVENT_LOOP=asyncio``, e.g. for asyncio's debug mode). The proxy's event loop is its throughput limit, and
    uvloop's transports and callbacks cost it ≈ 10 % less CPU per call (benchmarks/README.md)."""
    choice = os.environ.get(EVENT_LOOP_ENV, "").strip().lower()
    if choice not in ("", "uvloop", "asyncio"):
        raise SystemExit(f"{EVENT_LOOP_ENV}={choice!r}: use 'uvloop' or 'asyncio' (or leave it unset: uvloop)")
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise SystemExit(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed: pip install uvloop") from None
        return False
    return True


def run_main(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a process's top-level coroutine function on bridle's event loop (see :func:`use_uvloop`)."""
    return anyio.run(fn, *args, backend_options={"use_uvloop": use_uvloop()})


def event_loop_name() -> str:
    """The running loop's library: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def on_emergency(stop: Callable[[], None]) -> Callable[[], None]:
    """Register ``stop`` for a hard exit; returns the function that unregisters it."""
    key = id(stop)
    _EMERGENCY[key] = stop

    def unregister() -> None:
        _EMERGENCY.pop(key, None)

    return unregister


def emergency_stop() -> None:
    for stop in list(_EMERGENCY.values()):
        try:
            stop()
        except Exception as e:  # noqa: BLE001 — one failed kill must not keep the others from running
            get_logger(actor="supervisor").warning("emergency stop failed", error=repr(e))


def exit_now(code: int) -> NoReturn:
    """End the process without waiting for worker threads (a learner step or a model build abandoned on
    cancellation would otherwise hold the exit until it finished)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _root_cause(e: BaseException) -> BaseException:
    """The one error inside task-group wrappers (an actor's own task group wraps what one of its tasks raised)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


class ActorCrashed(Exception):
    def __init__(self, actor: str, error: BaseException) -> None:
        super().__init__(f"actor {actor!r} crashed: {type(error).__name__}: {error}")
        self.actor = actor
        self.error = error


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


Resolver = Callable[[str], type]


def make_resolver(registry: Mapping[str, str]) -> Resolver:
    """Kinds resolve through ``registry`` ("actors.toy:Source" -> "actors.toy:Source") or directly as "module:Class"."""

    def resolve(kind: str) -> type:
        target = registry.get(kind, kind)
        if ":" not in target:
            raise KeyError(f"not registered; known kinds: {', '.join(sorted(registry))}, or use module:Class")
        mod, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"{target} is not an Actor subclass")
        return cls

    return resolve


@dataclass
class Graph:
    actors: dict[str, Actor[Any]]
    feeds: dict[str, MemoryObjectSendStream[Message]]  # actor -> a sender into its inbox, for injection


def build_graph(
    exp: cfg.Experiment,
    resolve: Resolver,
    log: AsyncEventLog | None,
    *,
    only: set[str] | None = None,
    external_inputs: set[str] | None = None,
    run_dir: Path | None = None,
    resume: Resume | None = None,
) -> Graph:
    """Instantiate and wire the actors of ``exp``.

    ``only`` restricts the graph to some actors (replay); edges to actors outside it are dropped, edges from
    outside into it are replaced by ``feeds`` the caller writes to. ``external_inputs`` names actors that get a
    feed even without an incoming edge.
    """
    names = [n for n in exp.graph.actors if only is None or n in only]
    actors: dict[str, Actor[Any]] = {}
    for n in names:
        cls = resolve(exp.graph.actors[n])
        a = cls(n, exp.sections[n], ActorContext(run_dir=run_dir, resume=resume, run=exp.run))
        for o in cls.outputs:
            a.out[o] = Output(f"{n}.{o}", log)
        actors[n] = a
    edges = exp.graph.parsed_edges()
    needs_inbox = {dst for src, _o, dst in edges if dst in actors and src in actors}
    fed = {dst for src, _o, dst in edges if dst in actors and src not in actors} | (external_inputs or set())
    feeds: dict[str, MemoryObjectSendStream[Message]] = {}
    senders: dict[str, MemoryObjectSendStream[Message]] = {}
    for n in sorted(needs_inbox | (fed & set(actors))):
        size = exp.graph.inbox_sizes.get(n, exp.graph.queue_size)
        send, recv = anyio.create_memory_object_stream[Message](max_buffer_size=size)
        actors[n].inbox = recv
        senders[n] = send
    for src, o, dst in edges:
        if src in actors and dst in actors:
            actors[src].out[o].connect(senders[dst].clone())
    for n in fed & set(actors):
        feeds[n] = senders[n].clone()
    for s in senders.values():
        s.close()  # only the clones keep inboxes open
    return Graph(actors, feeds)


class Supervisor:
    """Runs a graph: one task group, event-log tap, signals, hot reload, clean shutdown."""

    def __init__(
        self,
        exp: cfg.Experiment,
        resolve: Resolver,
        log: AsyncEventLog | None,
        *,
        config_path: Path | None = None,
        handle_signals: bool = True,
        only: set[str] | None = None,
        external_inputs: set[str] | None = None,
        run_dir: Path | None = None,
        resume: Resume | None = None,
    ) -> None:
        self.exp = exp
        self.resolve = resolve
        self.eventlog = log
        self.config_path = config_path
        self.handle_signals = handle_signals
        self.graph = build_graph(exp, resolve, log, only=only, external_inputs=external_inputs, run_dir=run_dir,
                                 resume=resume)
        self.log = get_logger(actor="supervisor")
        self.crash: ActorCrashed | None = None
        self.interrupted: Interrupted | None = None
        self.reloads = 0
        self.refusals = 0
        self._actors_scope: anyio.CancelScope | None = None
        self._watch_stop = anyio.Event()
        self._waiting_for: set[str] = set()

    @property
    def actors(self) -> dict[str, Actor[Any]]:
        return self.graph.actors

    async def run(self, feeder: Callable[[Graph], Any] | None = None) -> None:
        """Run until every actor returned, an actor crashed (raises ActorCrashed) or a signal (raises Interrupted).

        ``feeder(graph)`` is an optional coroutine function that writes into ``graph.feeds`` (replay) and closes
        them when done.
        """
        async with anyio.create_task_group() as services:
            if self.eventlog is not None:
                services.start_soon(self.eventlog.run_flusher)
            if self.handle_signals:
                services.start_soon(self._watch_signals)
            if self.config_path is not None:
                await services.start(self._watch_config)
            try:
                await self._run_actors(feeder)
            finally:
                self._watch_stop.set()  # the watcher's thread only notices this event, not cancellation
                services.cancel_scope.cancel()
        if self.crash is not None:
            raise self.crash
        if self.interrupted is not None:
            raise self.interrupted

    async def _run_actors(self, feeder: Callable[[Graph], Any] | None) -> None:
        self.log.info("graph starting", actors=list(self.actors), edges=self.exp.graph.edges)
        with anyio.CancelScope() as scope:
            self._actors_scope = scope
            async with anyio.create_task_group() as tg:
                self._waiting_for = {n for n in self.exp.graph.stop_after if n in self.actors}
                for a in self.actors.values():
                    tg.start_soon(self._run_one, a, tg)
                if feeder is not None:
                    tg.start_soon(self._run_feeder, feeder, tg)
        self.log.info("graph stopped")

    async def _run_feeder(self, feeder: Callable[[Graph], Any], tg: TaskGroup) -> None:
        try:
            await feeder(self.graph)
        except Exception as e:  # a broken log must stop the replay as loudly as a crashed actor
            self.log.exception("feeder failed", error=repr(e))
            self.crash = ActorCrashed("replay-feeder", e)
            tg.cancel_scope.cancel()
        finally:
            for s in self.graph.feeds.values():
                s.close()

    async def _run_one(self, actor: Actor[Any], tg: TaskGroup) -> None:
        reason, error = "done", ""
        try:
            await actor.run()
        except anyio.get_cancelled_exc_class():
            reason = "cancelled"
            raise
        except Exception as e:
            cause = _root_cause(e)
            reason, error = "crashed", f"{type(cause).__name__}: {cause}"
            if isinstance(cause, cfg.ConfigError):  # phrased for the user (run.py prints it whole): no traceback
                first, _, more = str(cause).partition("\n")
                actor.log.error("actor refused its configuration; stopping the graph", error=first + (" …" if more else ""))
            else:
                actor.log.exception("actor crashed; stopping the graph", error=error)
            if self.crash is None:
                self.crash = ActorCrashed(actor.name, cause)
            tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for o in actor.out.values():
                    await o.aclose()
                if actor.inbox is not None:
                    await actor.inbox.aclose()
                if self.eventlog is not None:
                    self.eventlog.record_nowait(
                        "supervisor", ActorStopped(actor=actor.name, reason=reason, error=error)  # type: ignore[arg-type]
                    )
            if reason == "done":
                actor.log.info("actor finished")
                if actor.name in self._waiting_for:
                    self._waiting_for.discard(actor.name)
                    if not self._waiting_for:
                        self.log.info("run complete; stopping the other actors", after=self.exp.graph.stop_after)
                        tg.cancel_scope.cancel()

    def stop(self) -> None:
        """Cancel every actor (what a signal does)."""
        if self._actors_scope is not None:
            self._actors_scope.cancel()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
            async for signum in sigs:
                if self.interrupted is not None:
                    await self._exit_now()
                self.log.warning("signal received; stopping the graph (a second one exits at once)",
                                 signal=signal.Signals(signum).name)
                self.interrupted = Interrupted(signum)
                self.stop()

    async def _exit_now(self) -> None:
        """A second signal: no graceful shutdown, but nothing left behind. Kill what the graph started (the
        emergency stops registered by launchers and sandbox backends), write what the event log holds, exit 130.
        Never raises into a task: the process ends here."""
        self.log.warning("second signal: killing child processes and exiting now")
        emergency_stop()
        if self.eventlog is not None:
            with anyio.move_on_after(2.0, shield=True):
                await self.eventlog.flush()
            with contextlib.suppress(OSError):
                self.eventlog.close()
        exit_now(130)

    # ------------------------------------------------------------------------------------------ hot reload
    async def _watch_config(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        from watchfiles import awatch

        assert self.config_path is not None
        path = self.config_path.resolve()
        # Editors replace files by rename, so watch the directory; the filter keeps every other file of it out
        # (a resumed run's config lives in its run directory, which changes all the time).
        def only_this_file(_change: object, p: str) -> bool:
            return Path(p).resolve() == path

        task_status.started()
        async for _changes in awatch(path.parent, watch_filter=only_this_file, stop_event=self._watch_stop,
                                     debounce=200, step=50, rust_timeout=1000):
            await self.reload()

    async def reload(self) -> bool:
        """Re-read the experiment file, validate, diff, and hand each actor its changed section."""
        assert self.config_path is not None
        try:
            new = cfg.load_experiment(self.config_path, self.resolve, self.exp.overrides)
        except cfg.ConfigError as e:
            self.refusals += 1
            self.log.error("config reload refused: invalid file; nothing applied", error=str(e))
            await self._record(ConfigChanged(section="*", changes={}, accepted=False, reason=str(e)))
            return False
        d = cfg.diff(self.exp, new)
        if d.refused:
            self.refusals += 1
            why = f"fixed field(s) changed: {', '.join(d.refused)}; restart the run to change them"
            self.log.error("config reload refused; nothing applied", reason=why)
            await self._record(ConfigChanged(section="*", changes={}, accepted=False, reason=why))
            return False
        if not d.changes:
            return True
        for section, changes in d.changes.items():
            await self._record(ConfigChanged(section=section, changes=changes))
        for section, changes in d.changes.items():
            if section == "run":
                for actor in self.actors.values():
                    actor.ctx.run = new.run
                    await actor.on_run_config(new.run, changes)
            elif (actor := self.actors.get(section)) is not None:
                await actor.on_config(new.sections[section], changes)
            self.log.info("config reloaded", section=section, changes=changes)
        self.exp = new
        self.reloads += 1
        return True

    async def _record(self, msg: ConfigChanged) -> None:
        if self.eventlog is not None:
            await self.eventlog.record("config", msg)
        for actor in self.actors.values():
            await actor.on_reload(msg)
