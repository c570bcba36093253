"""Launching policy-engine processes (SGLang or the embedded engine), or attaching to a running server.

- :func:`launch_sglang`: ``python -m sglang.launch_server`` for a model folder (needs the ``sglang`` extra and a GPU).
- :func:`launch_embedded`: ``python -m pipeline.serving.embedded`` (our torch server) on a free port.
- :func:`attach`: an already running SGLang server or ``sglang_router`` (give the workers for control calls).
- :func:`wait_ready`: poll a server until it answers ``/health`` and ``/model_info``.
- :func:`process`: one child process in its own group, its output in a log file (also used for the router,
  :mod:`pipeline.serving.router`).

Each of the first three is an async context manager yielding a ready
:class:`pipeline.serving.sglang_client.HttpEngine`; a launched process (its own process group) is terminated on
exit. This module does not import torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import anyio

from pipeline.core.logs import get_logger
from pipeline.core.paths import REPO
from pipeline.core.runtime import on_emergency
from pipeline.serving.engine import EngineProcess
from pipeline.serving.sglang_client import HttpEngine

log = get_logger(actor="engine_launch")

# The embedded engine's prefix cache, in MiB of KV ([proxy.engine] prefix_cache_mb): a few Claude Code contexts of
# Qwen3-0.6B in bf16 (112 KiB a token), hundreds of the quickstart model's; memory is taken only as prompts fill it.
DEFAULT_PREFIX_CACHE_MB = 1024


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


async def wait_ready(
    client: HttpEngine,
    *,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll /health (then /model_info) until both answer; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"engine process exited with code {proc.returncode} before becoming ready; "
                f"log {log_path}:\n{_tail(log_path) if log_path else ''}"
            )
        if await client.health():
            await client.model_info()
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"engine at {client.base_url} not ready after {timeout_s:.0f}s; "
                f"log {log_path}:\n{_tail(log_path) if log_path else ''}"
            )
        await anyio.sleep(0.25)


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def process(
    name: str, cmd: list[str], *, log_path: Path | None, env: dict[str, str] | None = None,
    actor: str = "engine_launch",
) -> AsyncIterator[EngineProcess]:
    """Run ``cmd`` in its own process group with its output in ``log_path`` (a temporary file when None, removed
    after a clean stop); terminated (then killed) on exit, also when the run is cancelled. Its start and stop are
    logged as ``actor``'s."""
    plog = get_logger(actor=actor)
    own_log = log_path is None
    if log_path is None:
        fd, tmp = tempfile.mkstemp(prefix=f"bridle-{name}-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as logf:
            return subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )

    proc = await anyio.to_thread.run_sync(spawn)
    plog.info(f"{name} process started", pid=proc.pid, cmd=" ".join(cmd), log=str(log_path))
    unregister = on_emergency(lambda: _kill_group(proc.pid))
    try:
        yield EngineProcess(name, proc, log_path)
    finally:
        # Shielded: this runs when the run is cancelled (Ctrl-C, a crashed actor); without the shield the first
        # await would re-raise the cancellation and leave the process running.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_stop, proc)
            unregister()
        plog.info(f"{name} process stopped", pid=proc.pid, returncode=proc.returncode)
        if own_log and proc.returncode in (0, -signal.SIGTERM):
            log_path.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def _child(
    cmd: list[str],
    url_of: Callable[[subprocess.Popen, Path], Awaitable[str]],
    *,
    timeout_s: float,
    log_path: Path | None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[HttpEngine]:
    async with process("engine", cmd, log_path=log_path, env=env) as child:
        client: HttpEngine | None = None
        try:
            base_url = await url_of(child.process, child.log_path)
            client = HttpEngine(base_url)
            client.processes = [child]  # for the watchdog (pipeline/serving/watchdog.py)
            await wait_ready(client, timeout_s=timeout_s, proc=child.process, log_path=child.log_path)
            yield client
        finally:
            if client is not None:
                with anyio.CancelScope(shield=True):
                    await client.aclose()


def sglang_command(
    model_path: str | Path,
    *,
    host: str,
    port: int,
    weight_version: str,
    mem_fraction_static: float | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The ``sglang.launch_server`` command line (its flags are checked against SGLang's source in
    tests/serving/test_sglang_fidelity.py)."""
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--skip-server-warmup",
        "--weight-version",
        str(weight_version),
    ]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    return cmd + list(extra_args)


@contextlib.asynccontextmanager
async def launch_sglang(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    weight_version: str = "0",
    mem_fraction_static: float | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    timeout_s: float = 900.0,
    log_path: Path | None = None,
) -> AsyncIterator[HttpEngine]:
    """Launch ``sglang.launch_server`` and yield a client once /health and /model_info answer."""
    port = port or free_port(host)
    cmd = sglang_command(model_path, host=host, port=port, weight_version=weight_version,
                         mem_fraction_static=mem_fraction_static, extra_args=extra_args, python=python)

    async def url_of(proc: subprocess.Popen, log_path: Path) -> str:
        return f"http://{host}:{port}"

    async with _child(cmd, url_of, timeout_s=timeout_s, log_path=log_path) as client:
        yield client


@contextlib.asynccontextmanager
async def launch_embedded(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    weight_version: str = "0",
    max_running_requests: int = 32,
    threads: int = 0,
    context_length: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB,
    timeout_s: float = 180.0,
    log_path: Path | None = None,
    python: str = sys.executable,
) -> AsyncIterator[HttpEngine]:
    """Run ``python -m pipeline.serving.embedded`` on a free port and yield a ready client."""
    # Next to the log (the run folder) when there is one, named after it: a SIGKILLed run leaves nothing in /tmp,
    # and the next start of the run replaces what it left (an old port file would be read as the new engine's).
    if log_path is not None and log_path.parent.is_dir():
        port_dir = log_path.with_name(f"{log_path.name}.port")
        shutil.rmtree(port_dir, ignore_errors=True)
        port_dir.mkdir()
    else:
        port_dir = Path(tempfile.mkdtemp(prefix="bridle-engine-port-"))
    port_file = port_dir / "port"
    cmd = [
        python,
        "-m",
        "pipeline.serving.embedded",
        "--model",
        str(model_path),
        "--host",
        host,
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--weight-version",
        str(weight_version),
        "--max-running-requests",
        str(max_running_requests),
        "--threads",
        str(threads),
        "--device",
        device,
        "--dtype",
        dtype,
        "--prefix-cache-mb",
        str(prefix_cache_mb),
        "--parent-pid",  # the engine stops once this process is gone, also if killed while the engine loads
        str(os.getpid()),
    ]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    # The child must import this checkout's `pipeline` even when it is not installed.
    root = str(REPO)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    async def url_of(proc: subprocess.Popen, log_path: Path) -> str:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"embedded engine exited with code {proc.returncode} while loading {model_path}; "
                    f"log {log_path}:\n{_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"embedded engine did not start within {timeout_s:.0f}s; log {log_path}")
            await anyio.sleep(0.1)
        return f"http://{host}:{port_file.read_text().strip()}"

    try:
        async with _child(cmd, url_of, timeout_s=timeout_s, log_path=log_path, env=env) as client:
            yield client
    finally:
        port_file.unlink(missing_ok=True)
        os.rmdir(port_dir)


@contextlib.asynccontextmanager
async def attach(
    base_url: str, *, worker_urls: Sequence[str] | None = None, timeout_s: float = 60.0
) -> AsyncIterator[HttpEngine]:
    """A client for a running server or router; weight updates and pauses go to ``worker_urls`` when given, and
    those must all hold the same weight version."""
    client = HttpEngine(base_url, control_urls=worker_urls)
    try:
        await wait_ready(client, timeout_s=timeout_s)
        await client.check_versions()
        yield client
    finally:
        await client.aclose()
