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
from typing import Any

import anyio
import msgspec

from pipeline.core.config import ConfigError
from pipeline.core.runfiles import remove_prefixed, run_tag, safe_name
from pipeline.core.runtime import Actor, on_emergency
from pipeline.messages import EngineReady, Metric, PolicyUpdated, RolloutRequest, ServiceReady, SettledRollout
from pipeline.serving.factory import (
    EngineSettings,
    open_engine,
    open_renderer,
)
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.proxy_workers import ProxyWorkers, Setup
from pipeline.serving.watchdog import watch_engine
from pipeline.tokens.render import Renderer
from pipeline.tokens.template_check import TemplateMismatch, startup_check


class ProxyActor(Actor[ProxySettings]):
    Config = ProxySettings
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
        return msgspec.structs.replace(c, unix_socket=sock)

    async def run(self) -> None:
        engine_settings = self.config.engine
        renderer = open_renderer(engine_settings)
        self._check_template(renderer)
        async with open_engine(engine_settings, renderer, model=self.ctx.run.model, run_dir=self.run_dir) as engine:
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
            await self.send("engines", EngineReady(servers=list(getattr(engine, "control_urls", [])),
                                                   weight_version=self.config.engine.weight_version))

    @property
    def ready(self) -> anyio.Event:
        ev = self.__dict__.get("_ready")
        if ev is None:
            ev = self.__dict__["_ready"] = anyio.Event()
        return ev

    async def on_config(self, new: ProxySettings, changes: dict[str, Any]) -> None:
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
