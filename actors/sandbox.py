"""SandboxPool actor: runs each RolloutRequest in a fresh sandbox and reports RolloutFinished.

Inbox: ServiceReady (where the proxy listens; requests wait for it), RolloutRequest (already registered with the
proxy). Outputs: ``finished`` (to the collector and the scheduler), ``metrics``. ``concurrency`` is hot-reloadable:
it resizes the pool's limiter in place. ``[sandbox.judge]`` adds the rubric judge to every rollout's verdict
(``pipeline/rollout/judge.py``): the pool runs the verifiers, so the judge's settings are a table of its section.
"""

from __future__ import annotations

from typing import Any, Literal

import anyio
import msgspec

from pipeline.core.config import ConfigError, Experiment, PosInt
from pipeline.core.runfiles import run_tag
from pipeline.core.runtime import Actor
from pipeline.messages import Metric, RolloutFinished, RolloutRequest, ServiceReady
from pipeline.rollout.judge import Judge, JudgeSettings
from pipeline.rollout.sandbox import (
    DockerBackend,
    DockerSettings,
    LocalBackend,
    LocalSettings,
    SandboxBackend,
    SandboxCommon,
)
from pipeline.rollout.sandbox.ray_backend import RayBackend, RaySettings
from pipeline.rollout.tasks import TaskError, load_task

# The backend tables each backend reads ([sandbox.ray]'s nodes run the Docker backend).
BACKEND_TABLES: dict[str, frozenset[str]] = {
    "local": frozenset({"local"}), "docker": frozenset({"docker"}), "ray": frozenset({"ray", "docker"}),
}


class SandboxSettings(SandboxCommon):
    """``[sandbox]``: the pool (backend, concurrency), what every backend reads (SandboxCommon: turns, model name,
    rollout folders) and one table per backend; ``backend`` selects the tables that apply (BACKEND_TABLES), and a
    table set for another backend is refused, naming the backend that reads it."""

    backend: Literal["local", "docker", "ray"] = "local"  # where sandboxes run
    concurrency: PosInt = 4  # sandboxes at once (hot-reloadable)
    local: LocalSettings = msgspec.field(default_factory=LocalSettings)  # [sandbox.local]
    docker: DockerSettings = msgspec.field(default_factory=DockerSettings)  # also each Ray node's sandboxes
    ray: RaySettings = msgspec.field(default_factory=RaySettings)  # [sandbox.ray]
    judge: JudgeSettings | None = None  # the rubric judge; none: the rule reward alone
    reloadable = frozenset({"concurrency"})

    def check(self, name: str, exp: Experiment) -> None:
        for table, default in (("local", LocalSettings()), ("docker", DockerSettings()), ("ray", RaySettings())):
            if table not in BACKEND_TABLES[self.backend] and getattr(self, table) != default:
                readers = " or ".join(f'"{b}"' for b, tables in BACKEND_TABLES.items() if table in tables)
                field = next(f.name for f in msgspec.structs.fields(default)
                             if getattr(getattr(self, table), f.name) != getattr(default, f.name))
                raise ConfigError(
                    f'{exp.source}: [{name}.{table}] {field} is set, but [{name}.{table}] is read by backend = '
                    f'{readers} only, and [{name}].backend = "{self.backend}". Remove it, or set backend = '
                    f"{readers.split(' or ')[0]} (what every backend reads, such as max_turns, is [{name}]'s own)")
        if self.backend == "ray":
            if self.warm:
                raise ConfigError(f'{exp.source}: [{name}] warm = {self.warm}: the ray backend has no warm pool yet '
                                  f'(each node runs one rollout per worker); set warm = 0, or backend = "docker"')
            try:
                self.ray.check(f"[{name}.ray]")
            except ValueError as e:
                raise ConfigError(f"{exp.source}: {e}") from None
            if self.docker.network == "host":
                raise ConfigError(f'{exp.source}: [{name}.docker] network = "host" cannot reach the proxy from '
                                  f'another node; the ray backend needs "none" or "bridge" (its relays)')
        if self.judge is not None:
            self.judge.check(f"[{name}].judge", exp.source)
        for why in (self.docker.problem(f"[{name}.docker]") if self.backend in ("docker", "ray") else "",
                    self.local.problem(f"[{name}.local]") if self.backend == "local" else ""):
            if why:
                raise ConfigError(f"{exp.source}: {why}")


class SandboxPool(Actor[SandboxSettings]):
    Config = SandboxSettings
    outputs = ("finished", "metrics")

    def _backend(self, run_id: str) -> SandboxBackend | RayBackend:
        c = self.config
        backend: SandboxBackend | RayBackend
        if c.backend == "ray":
            backend = RayBackend(c.ray, c.docker, c, run_id=run_id)
        elif c.backend == "docker":
            backend = DockerBackend(c.docker, c, run_id=run_id)
        else:
            backend = LocalBackend(c.local, c, run_id=run_id)
        if self.config.judge is not None:
            backend.judge = Judge(self.config.judge)
        return backend

    async def run(self) -> None:
        # The run's tag: a restart of this run (--resume) finds and removes what a crash of it left
        backend = self._backend(run_tag(self.run_dir))
        self.limiter = anyio.CapacityLimiter(self.config.concurrency)
        self.running = 0
        service: ServiceReady | None = None
        waiting: list[RolloutRequest] = []
        await backend.start()
        warm = anyio.CancelScope()  # the warm pool's refills: stopped once every rollout is done

        async def keep_warm() -> None:
            with warm:
                await backend.keep_warm()
        try:
            async with anyio.create_task_group() as pool:
                if isinstance(backend, SandboxBackend):
                    pool.start_soon(keep_warm)
                async with anyio.create_task_group() as tg:
                    async for msg in self.messages():
                        if isinstance(msg, ServiceReady):
                            service = msg
                            for req in waiting:
                                tg.start_soon(self._one, backend, req, service)
                            waiting.clear()
                        elif isinstance(msg, RolloutRequest):
                            if service is None:
                                waiting.append(msg)
                            else:
                                tg.start_soon(self._one, backend, msg, service)
                warm.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await backend.aclose()
                if backend.judge is not None:
                    await backend.judge.aclose()

    async def _one(self, backend: SandboxBackend | RayBackend, req: RolloutRequest, service: ServiceReady) -> None:
        async with self.limiter:
            self.running += 1
            try:
                try:
                    task = load_task(req.task_path)
                except TaskError as e:
                    fin = RolloutFinished(rollout_id=req.rollout_id, group_id=req.group_id, status="sandbox_error",
                                          details=f"task {req.task_path}: {e}")
                else:
                    # with [proxy] workers > 1 the rollout's own worker, which alone knows its token
                    at = req.proxy or service
                    fin = await backend.run(req, task, proxy_url=at.base_url, proxy_socket=at.unix_socket)
            finally:
                self.running -= 1
        self.log.debug("rollout finished", rollout=req.rollout_id, status=fin.status, reward=fin.reward)
        await self.send("finished", fin)
        if self.out["metrics"].connected:
            kind = "demonstration" if req.purpose == "sft" else "rollout"
            counts = backend.metrics() if isinstance(backend, SandboxBackend) else {}
            await self.send("metrics", Metric(source=self.name, kind=kind, values={
                "rollouts_running": self.running, "reward": fin.reward, "ok": float(fin.status == "ok"), **counts}))

    async def on_config(self, new: SandboxSettings, changes: dict[str, Any]) -> None:
        self.config = new
        if "concurrency" in changes:
            self.limiter.total_tokens = new.concurrency
            self.log.info("sandbox concurrency changed", concurrency=new.concurrency)
