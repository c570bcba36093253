"""The sandbox backend base: one template, :meth:`SandboxBackend.run`, decides every rollout's status.

A backend implements hooks that each do one piece of its own work and report how it went; the template calls them
in order and turns that into the :class:`~pipeline.messages.RolloutFinished`, in this one place:

1. :meth:`~SandboxBackend.prepare` lays out the sandbox: the workspace seeded from the task, the harness's launch
   (what the adapter in ``pipeline/rollout/harnesses.py`` says), its config files, the task's ``solution/`` for a
   harness that needs it;
2. :meth:`~SandboxBackend.launch` starts the harness (``timings.sandbox_ready``);
3. :meth:`~SandboxBackend.wait` waits until it exits or the request's ``timeout_s`` passes (the task's
   ``[agent] timeout_sec`` when that is shorter; then kills it) and says how it ended (:class:`HarnessExit`);
   :meth:`~SandboxBackend.logs` gives its output's tail;
4. :meth:`~SandboxBackend.release` keeps what should outlive the harness (its transcript) and frees what it held
   (``timings.harness_done``);
5. :meth:`~SandboxBackend.verify` runs the task's verifier over the workspace in a process or container of its
   own, after the harness is gone; with a rubric judge (:attr:`SandboxBackend.judge`, ``[sandbox.judge]``) the
   template then mixes the judge's score of the workspace into the rule reward (``timings.verified``);
6. :meth:`~SandboxBackend.cleanup` always runs, shielded from cancellation and bounded by ``cleanup_timeout_s``.

The status tells the failure classes apart:

- ``ok``: the harness exited 0 and the verifier produced a reward; details are bridle's one-line summary of the
  verdict (never the verifier's output: what runs in the sandbox must not write into the event log);
- ``timeout``: the harness was killed at its wall-clock limit; the workspace is still scored (running out of time
  is the policy's doing);
- ``harness_error``: the harness exited non-zero, or the kernel killed it at the memory limit; no reward;
- ``sandbox_error``: the sandbox could not be prepared or started (unknown harness, missing executable, image or
  socket, a task without the ``solution/`` its harness needs), or it died under the harness (killed or removed
  from outside, the engine failed); no reward;
- ``verifier_error``: the verifier wrote no valid reward, failed or timed out, or the judge gave no usable score
  and its ``on_failure`` is ``verifier_error``; no reward.

``run`` never raises for these (they are statuses); cancellation propagates after the sandbox has been destroyed.
"""

from __future__ import annotations

import os
import time
import uuid
from abc import ABC, abstractmethod
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import anyio
import msgspec

from pipeline.core.config import NonNegFloat, NonNegInt, PosInt, Section
from pipeline.core.logs import get_logger
from pipeline.messages import RolloutFinished, RolloutRequest, RolloutStatus, RolloutTimings
from pipeline.rollout.harnesses import Harness, Launch, sandbox_harness
from pipeline.rollout.judge import Judge, Judged
from pipeline.rollout.sandbox.util import HARNESS_OUTPUT, tail
from pipeline.rollout.sandbox.warm import CreationGate, WarmPool
from pipeline.rollout.tasks import Task

log = get_logger(component="sandbox")

CLEANUP_TIMEOUT_S = 30.0


class SandboxCommon(Section):
    """What every backend reads: how the harness runs and what is kept of a rollout (``[sandbox]``'s own fields;
    the backends' tables hold only what is theirs)."""

    max_turns: PosInt = 30  # the harness's own turn limit, passed on its command line
    model: str = "policy"  # the model name the harness is told to use (the proxy serves every name)
    whitebox_args: list[str] = msgspec.field(default_factory=list)  # extra white-box harness flags
    workdir: str = ""  # where per-rollout folders go (Docker: bind-mounted; default: the system temp dir)
    # keep each rollout's folder: app/, home/ (the harness's HOME, with its transcript; in Docker a bind mount
    # instead of a tmpfs), tests/, logs/
    keep_workspaces: bool = False
    # Sandboxes started ahead per kind (Docker: image, harness, limits; local: one kind), each serving one rollout
    # (pipeline/rollout/sandbox/warm.py); 0: every sandbox starts when its rollout comes. Not on the ray backend.
    warm: NonNegInt = 0
    creations_per_s: NonNegFloat = 0.0  # sandbox creations a second on this host, all bridle processes (0: any)
    creations_at_once: NonNegInt = 0  # sandbox creations under way on this host, all bridle processes (0: any)

    @classmethod
    def of(cls, settings: SandboxCommon) -> SandboxCommon:
        """These fields alone of ``settings`` (a [sandbox] section is one, with the pool's own fields too): what is
        sent to a Ray node, which decodes exactly this struct."""
        return cls(**{name: getattr(settings, name) for name in cls.__struct_fields__})


class SandboxError(Exception):
    """The sandbox could not be prepared or started, or it died under the harness: status ``sandbox_error``, with
    this message as the details."""


class VerifierError(Exception):
    """The verifier produced no valid reward: status ``verifier_error``, with this message as the details (bridle's
    own words: never quote what the sandbox wrote)."""


@dataclass(kw_only=True)
class Sandbox:
    """One rollout's sandbox on its way through the hooks; each backend subclasses it with its own state."""

    req: RolloutRequest
    task: Task
    harness: Harness
    variant: str  # what followed "name:" in req.harness ("" if nothing)
    proxy_url: str
    proxy_socket: str
    root: Path | None = None  # the rollout's directory on this host, once prepare has made it
    launch: Launch | None = None  # how the harness starts, once prepared
    # What the rollout's details should say whatever its status (a task setting not honoured, a limit capped):
    # bridle's own words, appended as "note: ..." lines.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HarnessExit:
    """How the harness ended, as :meth:`SandboxBackend.wait` saw it."""

    timed_out: bool  # still running at the request's timeout, so killed by the backend
    exit_code: int | None  # as the sandbox reports it (a killed process: -9 locally, 137 in Docker)
    out_of_memory: bool = False  # killed by the kernel at the sandbox's memory limit
    killed_from_outside: bool = False  # killed by someone other than the backend (docker kill / stop / rm -f)


@dataclass(frozen=True)
class Verdict:
    """What the verifier said about the workspace."""

    reward: float
    rewards: dict[str, float]  # named parts: rule, judge, ...
    summary: str  # bridle's own words about it (no byte the sandbox wrote): RolloutFinished.details


S = TypeVar("S", bound=Sandbox)


class SandboxBackend(ABC, Generic[S]):
    """Runs one rollout per :meth:`run`; subclasses implement the hooks (see the module docstring)."""

    kind: ClassVar[str]  # the config's sandbox.backend value
    sandbox_type: type[S]  # the backend's Sandbox subclass, made fresh for each rollout
    cleanup_timeout_s: float = CLEANUP_TIMEOUT_S
    memory_limit: str | None = None  # the harness's memory limit as configured, for the out-of-memory message
    judge: Judge | None = None  # the rubric judge, when configured (its owner closes it)
    # Rollout folders are kept: the harness's output (the sandbox's text, which never goes into
    # RolloutFinished.details nor the event log) is kept in them as logs/harness.txt
    keep_workspaces: bool = False

    def __init__(self, *, run_id: str = ""):
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.pool: WarmPool[Any] | None = None  # the backend makes one when [sandbox] warm > 0
        self.gate = CreationGate()

    def _warm_from(self, common: SandboxCommon) -> None:
        self.gate = CreationGate(common.creations_per_s, common.creations_at_once)
        if common.warm > 0:
            self.pool = WarmPool(common.warm, make=self._make_warm, alive=self._warm_alive,
                                 destroy=self._destroy_warm)

    async def keep_warm(self) -> None:
        """Keep the warm pool filled until cancelled (the owner runs this beside its rollouts; nothing to do
        without a pool)."""
        if self.pool is not None:
            await self.pool.keep_warm()

    def metrics(self) -> dict[str, float]:
        """Counters for the run's metrics: the pool's hand-outs and the creations the gate let through."""
        return {**(self.pool.metrics() if self.pool is not None else {}), **self.gate.metrics()}

    async def _make_warm(self, key: Any, template: Any) -> Any:
        raise NotImplementedError(f"the {self.kind} backend has no warm pool")

    async def _warm_alive(self, entry: Any) -> bool:
        raise NotImplementedError

    async def _destroy_warm(self, entry: Any) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------------------------------------- lifecycle
    @abstractmethod
    async def start(self) -> None:
        """Prepare the backend and remove what a crashed earlier run left behind."""

    @abstractmethod
    async def aclose(self) -> None:
        """Destroy every sandbox this backend still holds."""

    # ------------------------------------------------------------------------------------------------ hooks
    @abstractmethod
    async def prepare(self, box: S) -> None:
        """Lay out the sandbox and set ``box.root`` (as soon as it exists: cleanup removes it) and
        ``box.launch``. Raises SandboxError, or OSError / ValueError (both become ``sandbox_error``)."""

    @abstractmethod
    async def launch(self, box: S) -> None:
        """Start the harness. Raises SandboxError when it cannot."""

    @abstractmethod
    async def wait(self, box: S, timeout_s: float) -> HarnessExit:
        """Wait until the harness exits, or kill it after ``timeout_s``; nothing of it may run on afterwards.
        Raises SandboxError when the sandbox disappears or its engine fails meanwhile."""

    @abstractmethod
    async def logs(self, box: S) -> str:
        """The tail of the harness's output (stdout and stderr); "" when there is none."""

    async def release(self, box: S) -> None:
        """The harness has ended: keep what should outlive it, free what it held. Default: nothing to do."""
        return

    @abstractmethod
    async def verify(self, box: S) -> Verdict:
        """Score the workspace with the task's verifier. Raises VerifierError without a valid reward."""

    def workspace(self, box: S) -> Path:
        """The workspace's folder on this host (what the judge reads)."""
        assert box.root is not None
        return box.root / "app"

    @abstractmethod
    async def cleanup(self, box: S) -> None:
        """Destroy the sandbox; called once per rollout whatever happened, already shielded and time-bounded."""

    # --------------------------------------------------------------------------------------------- template
    async def run(
        self, req: RolloutRequest, task: Task, *, proxy_url: str, proxy_socket: str = ""
    ) -> RolloutFinished:
        """One rollout, start to finish. Never raises for rollout failures (they are statuses); cancellation
        propagates after the sandbox has been destroyed. ``proxy_socket``: the proxy's Unix socket, for a
        sandbox that reaches the proxy through it."""
        finish = _Finisher(req)
        t = finish.timings
        box: S | None = None
        try:
            try:
                harness, variant = _harness(req, task)
                box = self.sandbox_type(req=req, task=task, harness=harness, variant=variant, proxy_url=proxy_url,
                                        proxy_socket=proxy_socket)
                finish.notes = box.notes
                await self.prepare(box)
            except SandboxError as e:
                return finish("sandbox_error", str(e))
            except (OSError, ValueError) as e:
                return finish("sandbox_error", f"could not prepare the sandbox: {type(e).__name__}: {e}")
            try:
                await self.launch(box)
            except SandboxError as e:
                return finish("sandbox_error", str(e))
            t.sandbox_ready = time.time()

            limit_s = harness_limit(req, task)
            try:
                ended = await self.wait(box, limit_s)
            except SandboxError as e:
                await self._keep_output(box)
                return finish("sandbox_error", f"{e}{self._output_note(box)}")
            await self._keep_output(box)
            await self.release(box)
            t.harness_done = time.time()
            failed = self._harness_failed(ended, box)
            if failed is not None:
                return finish(*failed, exit_code=ended.exit_code)

            try:
                verdict = await self.verify(box)
                if self.judge is not None and judged(req):
                    verdict = await self._judged(box, verdict)
            except VerifierError as e:
                t.verified = time.time()
                return finish("verifier_error", str(e), exit_code=ended.exit_code)
            t.verified = time.time()
            if ended.timed_out:
                return finish("timeout", f"harness killed after {limit_s:g}s ({limit_source(req, task)})"
                              f"{self._output_note(box)}",
                              reward=verdict.reward, rewards=verdict.rewards)
            return finish("ok", verdict.summary, reward=verdict.reward, rewards=verdict.rewards, exit_code=0)
        finally:
            if box is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.cleanup_timeout_s):
                    await self.cleanup(box)

    async def _judged(self, box: S, verdict: Verdict) -> Verdict:
        """``verdict`` with the judge's score mixed in. Raises VerifierError when the judge failed and its
        ``on_failure`` is ``verifier_error``."""
        assert self.judge is not None
        j = await self.judge.judge(box.task, self.workspace(box), verdict.reward, verdict.rewards)
        return judged_verdict(verdict, j, self.judge.settings.on_failure)

    def memory_limit_of(self, box: S) -> str | None:
        """The memory limit ``box``'s harness ran under, in words (a backend whose limit depends on the task
        overrides this)."""
        return self.memory_limit

    def _harness_failed(self, ended: HarnessExit, box: S) -> tuple[RolloutStatus, str] | None:
        """(status, details) when the way the harness ended leaves nothing to verify; None when the workspace is
        to be scored (it exited 0, or ran out of time)."""
        note = self._output_note(box)
        if ended.timed_out:
            return None
        if ended.out_of_memory:
            return "harness_error", f"the harness ran out of memory (limit {self.memory_limit_of(box)}){note}"
        if ended.killed_from_outside:
            return "sandbox_error", f"the sandbox was killed from outside{note}"
        if ended.exit_code != 0:
            return "harness_error", f"harness exited with {ended.exit_code}{note}"
        return None

    async def _keep_output(self, box: S) -> None:
        if not self.keep_workspaces or box.root is None:
            return
        out = box.root / "logs" / HARNESS_OUTPUT
        if out.is_symlink() or out.exists():  # the local backend's harness wrote it there itself
            return
        text = await self.logs(box)
        with suppress(OSError):
            out.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)

    def _output_note(self, box: S) -> str:
        if self.keep_workspaces and box.root is not None:
            return f" (its output: logs/{HARNESS_OUTPUT} in the kept rollout folder {box.root.name})"
        return " (its output is kept with [sandbox] keep_workspaces = true)"


def judged(req: RolloutRequest) -> bool:
    """Whether the rubric judge scores this rollout: not a cold-start demonstration (the SFT trains on the oracle's
    calls without a reward, so a judge call there only costs, and a failed one would drop the demonstration)."""
    return req.purpose != "sft"


def judged_verdict(verdict: Verdict, j: Judged, on_failure: str) -> Verdict:
    """The rule ``verdict`` with the judge's outcome ``j`` mixed in; VerifierError when the judge failed and
    ``on_failure`` (``[sandbox.judge]``) is ``verifier_error``."""
    if j.error and on_failure == "verifier_error":
        raise VerifierError(f"the judge failed: {j.error}")
    summary = f"{j.note}; verifier: {verdict.summary}" if j.note else verdict.summary
    return Verdict(reward=j.reward, rewards=j.rewards, summary=summary)


def harness_limit(req: RolloutRequest, task: Task) -> float:
    """The harness's wall-clock limit: the request's ``timeout_s``, or the task's ``[agent] timeout_sec`` when it
    asks for less (Harbor's agent timeout)."""
    asked = task.config.agent.timeout_sec
    return min(req.timeout_s, asked) if asked is not None else req.timeout_s


def limit_source(req: RolloutRequest, task: Task) -> str:
    """Which setting gave :func:`harness_limit`, in the words a person can act on."""
    asked = task.config.agent.timeout_sec
    if asked is not None and asked < req.timeout_s:
        return f"task {task.id}'s [agent] timeout_sec"
    return "[eval] timeout_s" if req.purpose == "eval" else "[scheduler] timeout_s"


def _harness(req: RolloutRequest, task: Task) -> tuple[Harness, str]:
    """The request's harness adapter and variant, once it is known that the sandboxes can run it on ``task``."""
    harness, variant = sandbox_harness(req.harness)
    if harness.needs_solution and not (task.root / "solution").is_dir():
        raise SandboxError(f"task {task.id} has no solution/ for the {harness.name} harness")
    return harness, variant


class _Finisher:
    """Builds the RolloutFinished of one request while its timings fill in, and logs it."""

    def __init__(self, req: RolloutRequest):
        self.req = req
        self.timings = RolloutTimings(queued=time.time())
        self.notes: list[str] = []

    def __call__(self, status: RolloutStatus, details: str = "", **kw: Any) -> RolloutFinished:
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        # The notes are bridle's and short; the details' own tail is cut to leave room for them.
        fin = RolloutFinished(rollout_id=self.req.rollout_id, group_id=self.req.group_id, status=status,
                              details=(tail(details) + notes).lstrip("\n"), timings=self.timings, **kw)
        log.debug("rollout_finished", rollout=self.req.rollout_id, harness=self.req.harness, task=self.req.task_id,
                 status=status, reward=fin.reward, exit_code=fin.exit_code)
        return fin
