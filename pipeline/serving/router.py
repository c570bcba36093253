"""Several policy engines behind one URL: the real ``sglang-router`` (PyPI, the ``router`` extra; checked with
:data:`ROUTER_VERSION`) in front of N workers.

- :class:`RouterSettings`: ``[proxy.engine.router]``.
- :func:`router_command`: ``python -m sglang_router.launch_router`` over given workers, under
  :mod:`pipeline.serving.router_guard` (which stops it if bridle is killed).
- :func:`launch_router`: start it and wait until it routes to every worker.
- :func:`launch_embedded_fleet`: ``replicas`` embedded engines (each its own process, port and copy of the weights)
  behind a launched router; :func:`launch_router_over`: a launched router over running SGLang servers.

Both fleets are one :class:`~pipeline.serving.sglang_client.HttpEngine`: ``/generate`` goes through the router, which
passes the worker's answer through untouched (``meta_info.weight_versions`` included); control calls go to every
worker directly, because the router forwards none of ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/abort_request`` (it answers 404). A weight update therefore reaches every worker, and
returns only when all report the new version. The watchdog watches the router and every worker bridle started.

What the router asks of a worker (seen from the embedded engine's side): ``GET /health`` (at registration and every
``--health-check-interval-secs``), ``/server_info`` and ``/model_info`` at registration, an HTTP/2 preface (it
tries gRPC first), and ``/flush_cache``, ``/get_model_info``, ``/get_server_info`` when a client asks the router.
It rewrites a ``/generate`` body on the way (it adds its own defaults and drops ``spaces_between_special_tokens``,
which only shapes ``text``; bridle reads ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.serving.engine import EngineProcess
from pipeline.serving.launch import free_port, launch_embedded, process, wait_ready
from pipeline.serving.sglang_client import HttpEngine

log = get_logger(actor="engine_launch")
ROUTER_VERSION = "0.3.2"  # the sglang-router release this module's flags and probes were checked against
INSTALL = "pip install -e '.[router]'"


class RouterSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[proxy.engine.router]``: the sglang-router bridle starts in front of several engines."""

    # "auto": cache_aware. A rollout's calls share their prefix, and cache_aware sends a call to the worker its prefix
    # went to, whose prefix cache (the embedded engine's) or radix cache (SGLang's) then reuses it; round_robin
    # reuses only what lands on the same worker by chance
    policy: Literal["auto", "round_robin", "cache_aware", "random"] = "auto"
    log_level: Literal["debug", "info", "warn", "error"] = "warn"  # "info" logs two lines per request
    args: list[str] = msgspec.field(default_factory=list)  # more launch_router arguments
    timeout_s: float = 120.0  # until the router routes to every worker

    def resolved_policy(self) -> str:
        return "cache_aware" if self.policy == "auto" else self.policy


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def router_command(
    worker_urls: Sequence[str],
    *,
    host: str,
    port: int,
    prometheus_port: int,
    policy: str,
    log_level: str = "warn",
    request_timeout_s: float = 3600.0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The guarded ``sglang_router.launch_router`` command line. Retries are off: a failed generation comes back
    to the proxy, which asks again itself ([proxy].engine_retries) and records the failure; the router's own
    retries (up to 5, backing off to 30 s) would hide it. Its metrics listen on a port of their own (the default,
    29000, would collide between runs)."""
    return [
        python, "-m", "pipeline.serving.router_guard",
        python, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-host", host,
        "--prometheus-port", str(prometheus_port),
        "--log-level", log_level,
        "--disable-retries",
        "--request-timeout-secs", str(int(request_timeout_s)),
        "--shutdown-grace-period-secs", "5",
        *extra_args,
    ]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


async def _healthy_workers(session: aiohttp.ClientSession, url: str) -> set[str] | None:
    """The workers the router routes to, by URL (``GET /workers``; ``/readiness`` would do, but the router logs each
    of its 503s before the workers register as an error, which reads as a failure in its log)."""
    try:
        async with session.get(f"{url}/workers", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            listed = (await resp.json(content_type=None)).get("workers") or []
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        return None
    return {str(w.get("url", "")).rstrip("/") for w in listed if isinstance(w, dict) and w.get("is_healthy")}


async def wait_routing(url: str, worker_urls: Sequence[str], *, timeout_s: float, child: EngineProcess) -> None:
    """Poll the router until every one of ``worker_urls`` is registered and healthy; fail early (with the end of
    its log) if it exits."""
    deadline = time.monotonic() + timeout_s
    want = {u.rstrip("/") for u in worker_urls}
    seen: set[str] | None = None
    async with aiohttp.ClientSession() as session:
        while True:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"the router exited with code {code} before routing to its workers; log "
                                   f"{child.log_path}:\n{_tail(child.log_path)}")
            got = await _healthy_workers(session, url)
            seen = got if got is not None else seen
            if seen is not None and want <= seen:
                return
            if time.monotonic() > deadline:
                missing = sorted(want - (seen or set()))
                raise TimeoutError(f"the router at {url} did not route to {missing} within {timeout_s:.0f}s; log "
                                   f"{child.log_path}:\n{_tail(child.log_path)}")
            await anyio.sleep(0.2)


@contextlib.asynccontextmanager
async def launch_router(
    worker_urls: Sequence[str],
    settings: RouterSettings,
    *,
    host: str = "127.0.0.1",
    log_path: Path | None = None,
) -> AsyncIterator[tuple[str, EngineProcess]]:
    """Start sglang-router over running ``worker_urls``; yield its URL and process once it routes to all."""
    if not router_available():
        raise RuntimeError(f"several engines need sglang-router in front of them, which is not installed: {INSTALL}")
    port = free_port(host)
    cmd = router_command(worker_urls, host=host, port=port, prometheus_port=free_port(host),
                         policy=settings.resolved_policy(), log_level=settings.log_level,
                         extra_args=settings.args)
    async with process("router", cmd, log_path=log_path, actor="router") as child:
        url = f"http://{host}:{port}"
        await wait_routing(url, worker_urls, timeout_s=settings.timeout_s, child=child)
        log.info("router ready", url=url, workers=list(worker_urls), policy=settings.resolved_policy())
        yield url, child


def numbered(log_path: Path | None, part: str) -> Path | None:
    """``engine-embedded.log`` -> ``engine-embedded-<part>.log``: one log per process of a fleet."""
    return None if log_path is None else log_path.with_name(f"{log_path.stem}-{part}{log_path.suffix}")


@contextlib.asynccontextmanager
async def _routed(
    worker_urls: list[str], workers: list[EngineProcess], settings: RouterSettings, *, log_path: Path | None,
) -> AsyncIterator[HttpEngine]:
    async with launch_router(worker_urls, settings, log_path=numbered(log_path, "router")) as (url, rp):
        client = HttpEngine(url, control_urls=worker_urls)
        client.processes = [rp, *workers]
        try:
            await client.check_versions()
            yield client
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()


@contextlib.asynccontextmanager
async def launch_embedded_fleet(
    model_path: str | Path, replicas: int, settings: RouterSettings, *, log_path: Path | None = None,
    **embedded: Any,
) -> AsyncIterator[HttpEngine]:
    """``replicas`` embedded engines (``embedded``: :func:`~pipeline.serving.launch.launch_embedded`'s options,
    per engine), started one after the other, behind a launched router."""
    async with contextlib.AsyncExitStack() as stack:
        urls: list[str] = []
        procs: list[EngineProcess] = []
        for i in range(replicas):
            worker = await stack.enter_async_context(
                launch_embedded(model_path, log_path=numbered(log_path, str(i)), **embedded))
            urls.append(worker.base_url)
            procs += [dataclasses.replace(p, name=f"engine {i}") for p in worker.processes]
        async with _routed(urls, procs, settings, log_path=log_path) as client:
            yield client


@contextlib.asynccontextmanager
async def launch_router_over(
    worker_urls: Sequence[str], settings: RouterSettings, *, log_path: Path | None = None, timeout_s: float = 60.0,
) -> AsyncIterator[HttpEngine]:
    """A launched router over running SGLang servers (bridle watches the router's process, and the servers by
    ``/health``: a dead server fails the run either way, the router's health checks only mark it unhealthy)."""
    urls = [u.rstrip("/") for u in worker_urls]
    for url in urls:
        async with HttpEngine(url) as worker:
            await wait_ready(worker, timeout_s=timeout_s)
    async with _routed(urls, [], settings, log_path=log_path) as client:
        client.watch_health = True
        yield client
