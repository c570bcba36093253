"""Proxy actor: owns the policy engine and the HTTP proxy every harness talks to.

Inbox: RolloutRequest (register the token, then forward to the sandbox pool), SettledRollout (forget the token),
PolicyUpdated (load the new weights into the engine, unless the learner pushed them over the weight update group).
Outputs: ``rollouts`` (ServiceReady once, then every RolloutRequest), ``calls`` (CallStarted / ModelCall /
CallFailed), ``metrics``, ``engines`` (EngineReady once: the workers, for weight sync without the disk). With
``workers = N`` > 1 the proxy runs as N processes, each owning the rollouts routed to it
(pipeline/serving/proxy_workers.py); one keeps it in this process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import msgspec

from pipeline.core.config import ConfigError, NonNegFloat, NonNegInt, Port, PosFloat, PosInt, Section
from pipeline.core.runfiles import remove_prefixed, run_tag, safe_name
from pipeline.core.runtime import Actor, on_emergency
from pipeline.messages import EngineReady, Metric, PolicyUpdated, RolloutRequest, ServiceReady, SettledRollout
from pipeline.serving.factory import (
    EngineSettings,
    fleet_problem,
    open_engine,
    open_renderer,
    renderer_problem,
)
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.proxy_workers import ProxyWorkers, Setup
from pipeline.serving.watchdog import watch_engine
from pipeline.tokens.render import Renderer
from pipeline.tokens.template_check import TemplateMismatch, startup_check


class ProxyActorSettings(Section):
    """``[proxy]`` and ``[proxy.engine]``. The engine serves ``[run].model``."""

    host: str = "127.0.0.1"
    port: Port = 0
    unix_socket: str = "auto"  # "auto": a socket in a temp dir (for Docker sandboxes); "": TCP only
    keepalive_s: Annotated[float, msgspec.Meta(gt=0, le=15)] = 5.0  # SSE heartbeat; harnesses give up after ~15 s
    stream_head_s: NonNegFloat = 0.02  # a stream's head goes out when the engine has not answered within this
    max_body_bytes: PosInt = 32 << 20
    # what one sandbox can hold (docs/serving.md, "What a client can hold")
    request_timeout_s: PosFloat = 60.0
    max_connections: PosInt = 1024
    max_connections_per_token: PosInt = 64
    context_len: PosInt = 32768
    model_name: str = "policy"
    subagent_model: str = "policy-subagent"
    update_timeout_s: PosFloat = 600.0
    engine_retries: NonNegInt = 1  # a failed engine call is asked again this often before the harness is told
    # proxy processes, each owning the rollouts routed to it: one event loop tops out at ~1,000 fresh 2k-token
    # calls/s (docs/serving.md, "Proxy workers"); 1 serves in this process
    workers: PosInt = 1
    # before serving: is turn-by-turn rendering with splicing the template's own rendering (docs/tokens.md)?
    # "error" refuses to start on a mismatch, "warn" logs it and serves, "off" skips the check
    template_check: Literal["error", "warn", "off"] = "error"
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    reloadable = frozenset({"keepalive_s", "update_timeout_s"})

    def check(self, name: str, exp: Any) -> None:
        if self.engine.model:
            raise ConfigError(f"{exp.source}: [{name}.engine].model moved to [run].model (the policy the engine "
                              "serves is the one the learner trains); set it there")
        if self.engine.kind != "scripted" and not exp.run.model:
            raise ConfigError(f'{exp.source}: [run].model: the {self.engine.kind} engine ([{name}.engine].kind) '
                              "serves the policy in this HF folder; set it")
        for problem in (fleet_problem(self.engine), renderer_problem(self.engine, exp.run.model)):
            if problem:
                raise ConfigError(f"{exp.source}: {problem.replace('[engine]', f'[{name}.engine]')}")
        if self.workers > 1:
            if self.engine.kind == "scripted":
                raise ConfigError(f"{exp.source}: [{name}].workers = {self.workers}: the scripted engine lives in the "
                                  "proxy's process, which workers cannot reach; use workers = 1 with it")
            sandbox = exp.kind_section("sandbox")
            if (sandbox is not None and getattr(sandbox[1], "backend", "") == "ray"
                    and sandbox[1].ray.proxy_address):
                raise ConfigError(f"{exp.source}: [{name}].workers = {self.workers} with [{sandbox[0]}.ray] "
                                  f"proxy_address = {sandbox[1].ray.proxy_address!r}: that is one host:port, and each "
                                  f"worker listens on its own ([{name}] port + its index); leave proxy_address empty "
                                  f"and set [{name}] host to an address the Ray nodes reach")


class ProxyActor(Actor[ProxyActorSettings]):
    Config = ProxyActorSettings
    outputs = ("rollouts", "calls", "metrics", "engines")

    proxy: Proxy | None = None
    workers: ProxyWorkers | None = None
    _socket_dir: str = ""

    def settings(self) -> ProxySettings:
        c = self.config
        sock = c.unix_socket
        if sock == "auto" or c.workers > 1:
            # In the temp dir, not the run folder: a Unix socket's path must stay under 108 bytes. Named by run
            # and actor, so that a restart of this run removes the folder a crash left. Workers talk to this
            # actor through a socket there.
            prefix = f"bridle.sock-{run_tag(self.run_dir)}_{safe_name(self.name, 16)}_"
            remove_prefixed(tempfile.gettempdir(), prefix)
            self._socket_dir = tempfile.mkdtemp(prefix=prefix)
        if sock == "auto":
            sock = os.path.join(self._socket_dir, "proxy.sock")
        return ProxySettings(host=c.host, port=c.port, unix_socket=sock, keepalive_s=c.keepalive_s,
                             stream_head_s=c.stream_head_s,
                             max_body_bytes=c.max_body_bytes, context_len=c.context_len, model_name=c.model_name,
                             subagent_model=c.subagent_model, engine_retries=c.engine_retries,
                             request_timeout_s=c.request_timeout_s, max_connections=c.max_connections,
                             max_connections_per_token=c.max_connections_per_token)

    async def run(self) -> None:
        engine_settings = msgspec.structs.replace(self.config.engine, model=self.ctx.run.model)
        renderer = open_renderer(engine_settings)
        self._check_template(renderer)
        async with open_engine(engine_settings, renderer, run_dir=self.run_dir) as engine:
            if self.config.workers > 1:
                await self._run_workers(engine, engine_settings)
                return
            self.proxy = Proxy(engine, renderer, self._emit, self.settings())
            self.proxy.policy_version = self.config.engine.weight_version
            await self.proxy.start()
            socket_dir = self._socket_dir  # a hard exit (second Ctrl-C) removes it too
            unregister = on_emergency(lambda: shutil.rmtree(socket_dir, ignore_errors=True) if socket_dir else None)
            self.ready.set()
            try:
                async with anyio.create_task_group() as tg:
                    # A dead engine fails the run at once, with its exit code and log (pipeline/serving/watchdog.py)
                    tg.start_soon(watch_engine, engine)
                    await self._serve(engine)
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self.proxy.stop()
                if self._socket_dir:
                    shutil.rmtree(self._socket_dir, ignore_errors=True)
                unregister()

    async def _run_workers(self, engine: Any, engine_settings: EngineSettings) -> None:
        settings = self.settings()
        setup = Setup(proxy=settings, renderer=engine_settings, engine_url=engine.base_url,
                      control_urls=list(engine.control_urls), generate_timeout_s=engine.timeout_s,
                      policy_version=self.config.engine.weight_version)
        self.workers = ProxyWorkers(self.config.workers, settings, setup, self._emit, control_dir=self._socket_dir,
                                    log_dir=self.run_dir or Path(self._socket_dir))
        socket_dir = self._socket_dir
        unregister = on_emergency(lambda: shutil.rmtree(socket_dir, ignore_errors=True))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_engine, engine)
                await tg.start(self.workers.run)  # a worker that dies fails the run with its log's tail
                self.ready.set()
                await self._serve(engine)
                tg.cancel_scope.cancel()
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
            unregister()

    def _check_template(self, renderer: Renderer) -> None:
        """Refuse a template the splicer cannot serve faithfully, before an engine is started for it."""
        try:
            startup_check(renderer, self.config.template_check)
        except TemplateMismatch as e:
            raise ConfigError(
                f"[{self.name}.engine].renderer = {self.config.engine.renderer!r}: the chat template failed the "
                "start-up check (turn-by-turn rendering with splicing, what the proxy serves, against the template's "
                "own whole rendering and tool-call format; docs/tokens.md). Fix the template or "
                f'[{self.name}.engine].tool_format, or set [{self.name}].template_check = "warn" to serve it anyway.'
                f"\n{e}"
            ) from None

    async def _serve(self, engine: Any) -> None:
        if self.workers is not None:
            return await self._serve_workers(engine, self.workers)
        assert self.proxy is not None
        await self.send("rollouts", ServiceReady(service="proxy", base_url=self.proxy.base_url,
                                                 unix_socket=self.proxy.unix_socket))
        await self._announce(engine)
        if self.inbox is None:
            await anyio.sleep_forever()
        async for msg in self.messages():
            if isinstance(msg, RolloutRequest):
                self.proxy.register(msg)
                await self.send("rollouts", msg)
            elif isinstance(msg, SettledRollout):
                for eng, rid in self.proxy.forget(msg.request.rollout_id):
                    with anyio.move_on_after(5):
                        await eng.abort(rid)  # stragglers of a rollout settled by timeout
            elif isinstance(msg, PolicyUpdated):
                await self._update(engine, msg)

    async def _serve_workers(self, engine: Any, workers: ProxyWorkers) -> None:
        at = workers.endpoint
        await self.send("rollouts", ServiceReady(service="proxy", base_url=at.base_url, unix_socket=at.unix_socket))
        await self._announce(engine)
        if self.inbox is None:
            await anyio.sleep_forever()
        async for msg in self.messages():
            if isinstance(msg, RolloutRequest):
                await self.send("rollouts", await workers.register(msg))  # naming its worker
            elif isinstance(msg, SettledRollout):
                await workers.forget(msg.request.rollout_id)  # the worker aborts the rollout's stragglers
            elif isinstance(msg, PolicyUpdated):
                await self._update(engine, msg)

    async def _announce(self, engine: Any) -> None:
        """Tell the learner where the engine's workers are (weight sync without the disk)."""
        if self.out["engines"].connected:
            # the scripted engine has no workers: it takes weights only from disk
            await self.send("engines", EngineReady(workers=list(getattr(engine, "control_urls", [])),
                                                   weight_version=self.config.engine.weight_version))

    @property
    def ready(self) -> anyio.Event:
        ev = self.__dict__.get("_ready")
        if ev is None:
            ev = self.__dict__["_ready"] = anyio.Event()
        return ev

    async def on_config(self, new: ProxyActorSettings, changes: dict[str, Any]) -> None:
        self.config = new
        if self.proxy is not None and "keepalive_s" in changes:
            # Read per call: calls that start from now on use the new heartbeat.
            self.proxy.settings = msgspec.structs.replace(self.proxy.settings, keepalive_s=new.keepalive_s)
        if self.workers is not None and "keepalive_s" in changes:
            await self.workers.reconfigure(keepalive_s=new.keepalive_s)
        self.log.info("proxy settings changed", changes=changes)

    async def _emit(self, msg: Any) -> None:
        await self.send("calls", msg)

    async def _set_version(self, version: int) -> None:
        if self.workers is not None:
            await self.workers.set_version(version)
        else:
            assert self.proxy is not None
            self.proxy.policy_version = version

    async def _update(self, engine: Any, msg: PolicyUpdated) -> None:
        if not msg.weights_path:  # pushed by the learner (already loaded), or no new weights
            await self._set_version(msg.version)
            return
        # Shielded: a stop that lands mid-push (the run ending right after its last step) must not leave one engine
        # behind a router on the new weights and another on the old; the push is bounded by its own timeout.
        with anyio.CancelScope(shield=True), anyio.fail_after(self.config.update_timeout_s):
            t0 = anyio.current_time()
            await engine.update_weights(msg.weights_path, msg.version)
            dt = anyio.current_time() - t0
        await self._set_version(msg.version)
        self.log.info("engine weights updated", version=msg.version, seconds=round(dt, 3))
        if self.out["metrics"].connected:
            await self.send("metrics", Metric(source=self.name, kind="weight_sync", step=msg.step,
                                              values={"weight_update_s": dt, "policy_version": msg.version}))
