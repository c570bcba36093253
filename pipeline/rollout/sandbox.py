"""Sandbox backends: run one rollout's harness over a fresh workspace, verify it, tear everything down.

Both backends implement :class:`SandboxBackend`. Per rollout they lay out the task's starting workspace, start the
harness (``pipeline/harnesses.py`` says how) with the instruction, the proxy address and the rollout token, enforce
``RolloutRequest.timeout_s``, then run the task's verifier over the workspace and return a
:class:`~pipeline.messages.RolloutFinished` whose status tells the failure classes apart:

- ``ok``: the harness exited 0 and the verifier produced a reward;
- ``timeout``: the harness was killed at its wall-clock limit; the workspace is still scored (running out of time
  is the policy's doing);
- ``harness_error``: the harness exited non-zero (or ran out of memory) — no reward;
- ``sandbox_error``: the sandbox could not be prepared, or died under the harness (container killed or removed
  from outside, Docker errors) — no reward;
- ``verifier_error``: test.sh wrote no valid reward or timed out.

``local`` runs the harness as a child process of this one (own session/process group, rlimits, killed as a group
and by an environment marker so that even daemonized children die). It is convenient and the embedded default,
but it is **no security boundary**: the harness runs as your user and can read your files and reach the network.

``docker`` runs one container per rollout from the harness's image (``pipeline/images.py`` builds them): CPU,
memory and pids limits, never privileged, ``no-new-privileges``, network ``none`` by default. The proxy's Unix
socket is bind-mounted at ``/run/bridle/proxy.sock`` and the image's forwarder relays ``127.0.0.1:8080`` to it, so
the harness reaches the policy and nothing else. The verifier runs afterwards in a fresh container over the same
workspace with ``tests/`` mounted read-only; the harness never sees the tests. Containers carry the labels
``bridle.run`` / ``bridle.rollout`` / ``bridle.owner``; :meth:`DockerBackend.start` removes leftovers of this run
and of runs whose process has died, so a crash never leaks containers.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import aiohttp
import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.messages import RolloutFinished, RolloutRequest, RolloutTimings
from pipeline.rollout.harnesses import (
    CONTAINER_BINARIES,
    CONTAINER_WHITEBOX,
    IMAGES,
    Launch,
    LaunchContext,
    find_binary,
    harness_name,
    launch_for,
)
from pipeline.rollout.tasks import Task, seed_workspace
from pipeline.rollout.verify import RewardError, read_reward, run_verifier_local

log = get_logger(component="sandbox")

TAIL_CHARS = 1500
CLEANUP_TIMEOUT_S = 30.0
MARKER_RUN = "BRIDLE_SANDBOX_RUN"
MARKER_ID = "BRIDLE_SANDBOX_ID"


# -------------------------------------------------------------------------------------------- interface
class SandboxBackend(Protocol):
    async def start(self) -> None:
        """Prepare the backend and remove what a crashed earlier run left behind."""

    async def run(
        self, req: RolloutRequest, task: Task, *, proxy_url: str, proxy_socket: str = ""
    ) -> RolloutFinished:
        """One rollout, start to finish. Never raises for rollout failures (they are statuses); cancellation
        propagates after the sandbox has been destroyed."""

    async def aclose(self) -> None:
        """Destroy every sandbox this backend still holds."""


def _size(text: str | int | None, field: str) -> int | None:
    """"4g" / "512m" / "1024k" / 123 -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise ValueError(f'{field}: expected a size such as "4g", "512m" or a number of bytes, got {text!r}')
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def _tail(text: str, limit: int = TAIL_CHARS) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _file_tail(path: Path, limit: int = TAIL_CHARS) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit * 4))
            return _tail(f.read().decode("utf-8", "replace"), limit)
    except FileNotFoundError:
        return ""


def _rmtree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


class _Result:
    """Builds the RolloutFinished of one request while its timings fill in."""

    def __init__(self, req: RolloutRequest):
        self.req = req
        self.timings = RolloutTimings(queued=time.time())

    def __call__(self, status: str, details: str = "", **kw: Any) -> RolloutFinished:
        fin = RolloutFinished(
            rollout_id=self.req.rollout_id,
            group_id=self.req.group_id,
            status=status,  # type: ignore[arg-type]
            details=_tail(details),
            timings=self.timings,
            **kw,
        )
        log.info(
            "rollout_finished",
            rollout=self.req.rollout_id,
            harness=self.req.harness,
            task=self.req.task_id,
            status=status,
            reward=fin.reward,
            exit_code=fin.exit_code,
        )
        return fin


# ------------------------------------------------------------------------------------------------ local
class LocalSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The local backend. Limits are POSIX rlimits on the harness process (inherited by its children)."""

    workdir: str = ""  # where per-rollout directories go (default: the system temp dir)
    keep_workspaces: bool = False  # keep each rollout's directory (workspace, home, logs) for inspection
    cpu_seconds: int | None = None  # RLIMIT_CPU per process
    # RLIMIT_AS per process. Off by default: Node- and Bun-based harnesses reserve far more address space than
    # they use and fail to start under a small limit.
    memory: str | None = None
    file_size: str | None = "2g"  # RLIMIT_FSIZE: the largest file a harness may write
    open_files: int | None = 4096  # RLIMIT_NOFILE
    max_turns: int = 30
    model: str = "policy"
    harness_bin: str = ""  # folder with claude / codex executables (default: $BRIDLE_HARNESS_BIN, then PATH)
    whitebox_args: list[str] = msgspec.field(default_factory=list)  # extra white-box harness flags


# Applied between fork and exec by a tiny Python wrapper (anyio's open_process has no preexec_fn).
_RLIMIT_EXEC = (
    "import json,os,resource,sys\n"
    "for k,v in json.loads(sys.argv[1]).items():\n"
    " r=getattr(resource,k);h=resource.getrlimit(r)[1]\n"
    " v=v if h==resource.RLIM_INFINITY else min(v,h)\n"
    " resource.setrlimit(r,(v,v))\n"
    "try:os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:sys.stderr.write(f'cannot run {sys.argv[2]!r}: {e}\\n');sys.exit(127)\n"
)


def _marked_pids(marker: bytes) -> list[int]:
    """Processes of this user whose environment contains ``marker`` (``NAME=value``); empty without /proc."""
    found: list[int] = []
    needle = b"\0" + marker + b"\0"
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for e in entries:
        if not e.isdigit() or int(e) == me:
            continue
        try:
            with open(f"/proc/{e}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in b"\0" + env:
            found.append(int(e))
    return found


def kill_marked(marker: str, rounds: int = 5) -> int:
    """SIGKILL every process carrying ``marker`` in its environment, until none is left; return how many."""
    killed = 0
    for _ in range(rounds):
        pids = _marked_pids(marker.encode())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return killed


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalBackend:
    """Harness as a child process in a temporary directory. NOT a security boundary (see module docstring)."""

    kind = "local"

    def __init__(self, settings: LocalSettings | None = None, *, run_id: str = ""):
        self.settings = settings or LocalSettings()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._limits: dict[str, int] = {}
        s = self.settings
        for name, value in (
            ("RLIMIT_CPU", s.cpu_seconds),
            ("RLIMIT_AS", _size(s.memory, "memory")),
            ("RLIMIT_FSIZE", _size(s.file_size, "file_size")),
            ("RLIMIT_NOFILE", s.open_files),
            ("RLIMIT_CORE", 0),
        ):
            if value is not None:
                self._limits[name] = int(value)
        self._live: set[str] = set()

    async def start(self) -> None:
        n = kill_marked(f"{MARKER_RUN}={self.run_id}")
        if n:
            log.warning("reaped_processes", run=self.run_id, count=n)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(kill_marked, f"{MARKER_RUN}={self.run_id}")

    def _binary(self, harness: str) -> str:
        exe = {"claude-code": "claude", "codex": "codex"}.get(harness_name(harness))
        if exe is None:
            return ""
        if self.settings.harness_bin:
            p = Path(self.settings.harness_bin) / exe
            return str(p) if p.exists() else ""
        return find_binary(exe) or ""

    async def run(
        self, req: RolloutRequest, task: Task, *, proxy_url: str, proxy_socket: str = ""
    ) -> RolloutFinished:
        result = _Result(req)
        t = result.timings
        root: Path | None = None
        proc = None
        sandbox_id = f"{self.run_id}.{uuid.uuid4().hex[:8]}"
        try:
            try:
                base = self.settings.workdir or None
                if base:
                    Path(base).mkdir(parents=True, exist_ok=True)
                root = Path(tempfile.mkdtemp(prefix=f"bridle-{_safe(req.rollout_id)}-", dir=base))
                ws, home, logs = root / "app", root / "home", root / "logs"
                seed_workspace(task, ws)
                home.mkdir()
                logs.mkdir()
                name = harness_name(req.harness)
                solution = ""
                if name == "oracle":
                    if not (task.root / "solution").is_dir():
                        return result("sandbox_error", f"task {task.id} has no solution/ for the oracle harness")
                    shutil.copytree(task.root / "solution", root / "solution")
                    solution = str(root / "solution")
                binary = self._binary(req.harness)
                if name in ("claude-code", "codex") and not binary:
                    return result(
                        "sandbox_error",
                        f"{name} executable not found; install it (npm install @anthropic-ai/claude-code "
                        "@openai/codex) and set BRIDLE_HARNESS_BIN or LocalSettings.harness_bin to the "
                        "node_modules/.bin folder",
                    )
                ctx = LaunchContext(
                    workspace=str(ws),
                    home=str(home),
                    base_url=proxy_url.rstrip("/"),
                    token=req.token,
                    instruction=task.instruction,
                    model=self.settings.model,
                    max_turns=self.settings.max_turns,
                    binary=binary,
                    solution_dir=solution,
                    whitebox_args=list(self.settings.whitebox_args),
                )
                launch = launch_for(req.harness, ctx)
                _write_files(launch)
            except (OSError, ValueError) as e:
                return result("sandbox_error", f"could not prepare the sandbox: {type(e).__name__}: {e}")

            env = {
                "PATH": os.environ.get("PATH", os.defpath),
                **launch.env,
                MARKER_RUN: self.run_id,
                MARKER_ID: sandbox_id,
            }
            argv = [sys.executable, "-S", "-c", _RLIMIT_EXEC, json.dumps(self._limits), *launch.argv]
            out_path = logs / "harness.txt"
            try:
                with out_path.open("wb") as out:
                    proc = await anyio.open_process(
                        argv,
                        cwd=ws,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            except OSError as e:
                return result("sandbox_error", f"could not start {launch.argv[0]}: {e}")
            self._live.add(sandbox_id)
            t.sandbox_ready = time.time()
            with anyio.move_on_after(req.timeout_s) as scope:
                await proc.wait()
            with anyio.CancelScope(shield=True):
                await self._kill(proc.pid, sandbox_id)
                await proc.wait()
            t.harness_done = time.time()
            out_tail = _file_tail(out_path)
            timed_out = scope.cancelled_caught
            if not timed_out and proc.returncode != 0:
                return result(
                    "harness_error",
                    f"harness exited with {proc.returncode}:\n{out_tail}",
                    exit_code=proc.returncode,
                )
            vr = await run_verifier_local(task, ws, logs_dir=logs)
            t.verified = time.time()
            if vr.status != "ok":
                return result("verifier_error", f"{vr.error}\n{vr.stdout_tail}", exit_code=proc.returncode)
            if timed_out:
                return result(
                    "timeout",
                    f"harness killed after {req.timeout_s:g}s:\n{out_tail}",
                    reward=vr.reward,
                    rewards=vr.rewards,
                )
            return result("ok", vr.stdout_tail, reward=vr.reward, rewards=vr.rewards, exit_code=0)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
                if proc is not None and proc.returncode is None:
                    await self._kill(proc.pid, sandbox_id)
                    await proc.wait()
                self._live.discard(sandbox_id)
                if not self.settings.keep_workspaces:
                    await anyio.to_thread.run_sync(_rmtree, root)

    async def _kill(self, pgid: int, sandbox_id: str) -> None:
        _killpg(pgid)
        # Children that left the process group (setsid, daemonized servers) still carry the marker.
        await anyio.to_thread.run_sync(kill_marked, f"{MARKER_ID}={sandbox_id}")


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", s)[:40]


def _write_files(launch: Launch) -> None:
    for path, content in launch.files.items():
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content, encoding="utf-8")


# ----------------------------------------------------------------------------------------------- docker
CONTAINER_SOCKET = "/run/bridle/proxy.sock"
LABEL = "bridle.sandbox"


class DockerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Docker backend: one container per rollout, limits enforced by the engine."""

    cpus: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    memory: str = "2g"  # hard limit (swap included); the kernel OOM-kills the harness above it
    pids: Annotated[int, msgspec.Meta(gt=0)] = 512
    # none: loopback only, the proxy through the mounted socket + forwarder; bridge: also the outside network;
    # host: the host's network namespace, the harness uses proxy_url directly (no isolation).
    network: Literal["none", "host", "bridge"] = "none"
    images: dict[str, str] = msgspec.field(default_factory=dict)  # harness name -> image (default IMAGES)
    verifier_image: str = ""  # default: the base image
    forward_port: int = 8080  # the forwarder's port on the container's loopback
    workdir: str = ""  # host folder for per-rollout directories (bind-mounted; default: the system temp dir)
    # Keep each rollout's directory (app/, tests/, logs/) and copy the harness's transcript out of the container
    # into its home/ before the container is removed.
    keep_workspaces: bool = False
    max_turns: int = 30
    model: str = "policy"
    whitebox_args: list[str] = msgspec.field(default_factory=list)  # extra white-box harness flags
    docker_url: str = ""  # default: DOCKER_HOST, then the local socket
    api_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0  # any one Docker API call


def _tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    """An in-memory tar of absolute container paths -> (content, mode), for put_archive at "/"."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs: set[str] = set()
        for path in files:
            parts = Path(path.lstrip("/")).parts[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        for d in sorted(dirs):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
            tar.addfile(info)
        for path, (data, mode) in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Gone(Exception):
    """The container vanished or the engine failed under a running rollout."""


class DockerBackend:
    """One container per rollout from the harness's image (see module docstring)."""

    kind = "docker"

    def __init__(self, settings: DockerSettings | None = None, *, run_id: str = ""):
        self.settings = settings or DockerSettings()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.memory = _size(self.settings.memory, "memory")
        self.docker: Any = None
        self.host = socket.gethostname()
        self._live: set[str] = set()
        self._killed: set[str] = set()

    # ---------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        import aiodocker

        if self.docker is None:
            try:
                self.docker = aiodocker.Docker(url=self.settings.docker_url or None)
                with anyio.fail_after(self.settings.api_timeout_s):
                    await self.docker.version()
            except (aiodocker.DockerError, aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
                if self.docker is not None:
                    await self.docker.close()
                    self.docker = None
                raise RuntimeError(
                    f"cannot reach the Docker engine ({type(e).__name__}: {e}); start dockerd (see "
                    "harness_images/ci_setup.sh) or use the local sandbox backend"
                ) from None
        await self.reap()

    async def reap(self) -> int:
        """Remove containers of this run, and of runs on this host whose process is gone."""
        with anyio.fail_after(self.settings.api_timeout_s):
            found = await self.docker.containers.list(all="1", filters=json.dumps({"label": [LABEL]}))
        n = 0
        for c in found:
            labels = c._container.get("Labels") or {}
            mine = labels.get("bridle.run") == self.run_id and c.id not in self._live
            orphan = labels.get("bridle.host") == self.host and not _pid_alive(int(labels.get("bridle.owner", 0)))
            if mine or orphan:
                await self._remove(c.id)
                n += 1
        if n:
            log.warning("reaped_containers", run=self.run_id, count=n)
        return n

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for cid in list(self._live):
                await self._remove(cid)
            if self.docker is not None:
                with anyio.move_on_after(CLEANUP_TIMEOUT_S):
                    await self.docker.close()
                self.docker = None

    async def _remove(self, cid: str) -> None:
        import aiodocker

        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                await self.docker.containers.container(cid).delete(force=True, v=True)
            except aiodocker.DockerError as e:
                if e.status != 404:
                    log.warning("container_remove_failed", container=cid[:12], error=str(e))
        self._live.discard(cid)

    # ------------------------------------------------------------------------------------------ helpers
    def _labels(self, req: RolloutRequest, role: str) -> dict[str, str]:
        return {LABEL: "1", "bridle.run": self.run_id, "bridle.rollout": req.rollout_id, "bridle.role": role,
                "bridle.host": self.host, "bridle.owner": str(os.getpid())}

    def _host_config(self, binds: list[str], network: str) -> dict[str, Any]:
        s = self.settings
        return {
            "Binds": binds,
            "NetworkMode": network,
            "NanoCpus": int(s.cpus * 1e9),
            "Memory": self.memory,
            "MemorySwap": self.memory,  # no swap beyond the limit
            "PidsLimit": s.pids,
            "Privileged": False,
            "SecurityOpt": ["no-new-privileges"],
            "CapDrop": ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"],
            "Init": True,  # reap zombies; the harness's exit status becomes the container's
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "4m", "max-file": "1"}},
        }

    async def _create_start(self, config: dict[str, Any], files: dict[str, tuple[bytes, int]],
                            owned: list[Any]) -> Any:
        """Create and start a container; it goes into ``owned`` (the caller removes it) as soon as it exists."""
        # Shielded: a cancellation between the engine creating it and us learning its id would leak it.
        with anyio.CancelScope(shield=True), anyio.fail_after(self.settings.api_timeout_s):
            c = await self.docker.containers.create(config)
            self._live.add(c.id)
            owned.append(c)
        with anyio.fail_after(self.settings.api_timeout_s):
            if files:
                await c.put_archive("/", _tar(files))
            await c.start()
        return c

    async def _wait(self, c: Any, timeout: float) -> tuple[bool, dict[str, Any]]:
        """(timed out, final State). Raises _Gone when the container disappears or the engine fails."""
        import aiodocker

        try:
            with anyio.move_on_after(timeout) as scope:
                await c.wait()
            if scope.cancelled_caught:
                self._killed.add(c.id)
                with anyio.fail_after(self.settings.api_timeout_s):
                    try:
                        await c.kill()
                    except aiodocker.DockerError as e:
                        if e.status != 409:  # 409: it stopped on its own meanwhile
                            raise
                    await c.wait()
            with anyio.fail_after(self.settings.api_timeout_s):
                info = await c.show()
            return scope.cancelled_caught, info["State"]
        except aiodocker.DockerError as e:
            raise _Gone(f"the container disappeared or the engine failed: {e}") from None
        except TimeoutError:
            raise _Gone(f"the Docker engine did not answer within {self.settings.api_timeout_s:g}s") from None

    async def _logs(self, c: Any) -> str:
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                lines = await c.log(stdout=True, stderr=True, tail="200")
            return _tail("".join(lines))
        except (aiodocker.DockerError, TimeoutError):
            return ""

    async def _killed_from_outside(self, c: Any, since: float) -> bool:
        """Whether someone other than us sent the container a kill (docker kill / stop / rm -f)."""
        import aiodocker

        if c.id in self._killed:
            return False
        params = {"since": f"{since - 1:.3f}", "until": f"{time.time():.3f}",
                  "filters": json.dumps({"container": [c.id], "event": ["kill", "die", "oom"]})}
        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                async with self.docker._query("events", method="GET", params=params) as resp:
                    body = await resp.text()
        except (aiodocker.DockerError, aiohttp.ClientError, TimeoutError):
            return False  # events unavailable: fall back to the exit status alone
        events = [json.loads(line) for line in body.splitlines() if line.strip()]
        return any(e.get("Action") == "kill" for e in events) and not any(e.get("Action") == "oom" for e in events)

    def _image(self, name: str) -> str:
        return self.settings.images.get(name) or IMAGES[name]

    # --------------------------------------------------------------------------------------------- run
    async def run(
        self, req: RolloutRequest, task: Task, *, proxy_url: str, proxy_socket: str = ""
    ) -> RolloutFinished:
        import aiodocker

        if self.docker is None:
            raise RuntimeError("DockerBackend.run() before start(); call `await backend.start()` first")
        result = _Result(req)
        t = result.timings
        s = self.settings
        root: Path | None = None
        containers: list[Any] = []
        try:
            try:
                name = harness_name(req.harness)
                if s.network != "host" and not (proxy_socket and Path(proxy_socket).exists()):
                    return result("sandbox_error", f"network {s.network!r} reaches the proxy through its Unix "
                                  f"socket, but proxy_socket={proxy_socket!r} does not exist; set "
                                  "ProxySettings.unix_socket (or DockerSettings.network='host')")
                base = s.workdir or None
                if base:
                    Path(base).mkdir(parents=True, exist_ok=True)
                root = Path(tempfile.mkdtemp(prefix=f"bridle-{_safe(req.rollout_id)}-", dir=base))
                ws = root / "app"
                seed_workspace(task, ws)
                ws.chmod(0o777)  # the harness may run as any user inside the container
                files: dict[str, tuple[bytes, int]] = {}
                if name == "oracle":
                    sol = task.root / "solution"
                    if not sol.is_dir():
                        return result("sandbox_error", f"task {task.id} has no solution/ for the oracle harness")
                    for p in sol.rglob("*"):
                        if p.is_file():
                            files[f"/solution/{p.relative_to(sol).as_posix()}"] = (p.read_bytes(), 0o755)
                base_url = proxy_url.rstrip("/") if s.network == "host" else f"http://127.0.0.1:{s.forward_port}"
                ctx = LaunchContext(
                    workspace="/app", home="/root", base_url=base_url, token=req.token,
                    instruction=task.instruction, model=s.model, max_turns=s.max_turns,
                    binary=CONTAINER_BINARIES.get(name, ""), python="python3", whitebox_script=CONTAINER_WHITEBOX,
                    solution_dir="/solution" if name == "oracle" else "",
                    whitebox_args=list(s.whitebox_args),
                )
                launch = launch_for(req.harness, ctx)
                for path, content in launch.files.items():
                    files[path] = (content.encode(), 0o644)
            except (OSError, ValueError) as e:
                return result("sandbox_error", f"could not prepare the sandbox: {type(e).__name__}: {e}")

            cmd = launch.argv
            binds = [f"{ws}:/app"]
            if s.network != "host":
                cmd = ["python3", "/opt/bridle/forwarder.py", "--listen", f"127.0.0.1:{s.forward_port}",
                       "--socket", CONTAINER_SOCKET, "--", *cmd]
                binds.append(f"{Path(proxy_socket).resolve()}:{CONTAINER_SOCKET}")
            config = {
                "Image": self._image(name),
                "Cmd": cmd,
                "Env": [f"{k}={v}" for k, v in launch.env.items()],
                "WorkingDir": "/app",
                "Labels": self._labels(req, "harness"),
                "HostConfig": self._host_config(binds, s.network),
            }
            started = time.time()
            try:
                c = await self._create_start(config, files, containers)
            except aiodocker.DockerError as e:
                hint = "; build the images with `python run.py --build-images`" if e.status == 404 else ""
                return result("sandbox_error", f"could not start the container ({config['Image']}): {e}{hint}")
            except TimeoutError:
                return result("sandbox_error", f"Docker did not start the container within {s.api_timeout_s:g}s")
            t.sandbox_ready = time.time()

            try:
                timed_out, state = await self._wait(c, req.timeout_s)
            except _Gone as e:
                return result("sandbox_error", f"{e}\n{await self._logs(c)}")
            out_tail = await self._logs(c)
            exit_code = state.get("ExitCode")
            outside = not timed_out and exit_code == 137 and await self._killed_from_outside(c, started)
            if s.keep_workspaces and launch.transcript:
                await self._copy_out(c, launch.transcript, root / "home")
            await self._remove(c.id)
            t.harness_done = time.time()
            if not timed_out:
                if state.get("OOMKilled"):
                    return result("harness_error", f"the harness ran out of memory (limit {s.memory}):\n{out_tail}",
                                  exit_code=exit_code)
                if outside:
                    return result("sandbox_error", f"the container was killed from outside:\n{out_tail}",
                                  exit_code=exit_code)
                if exit_code != 0:
                    return result("harness_error", f"harness exited with {exit_code}:\n{out_tail}",
                                  exit_code=exit_code)

            verdict = await self._verify(req, task, root, containers)
            t.verified = time.time()
            if isinstance(verdict, str):
                return result("verifier_error", verdict, exit_code=exit_code)
            reward, rewards, v_tail = verdict
            if timed_out:
                return result("timeout", f"harness killed after {req.timeout_s:g}s:\n{out_tail}",
                              reward=reward, rewards=rewards)
            return result("ok", v_tail, reward=reward, rewards=rewards, exit_code=0)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S * 2):
                for c in containers:
                    await self._remove(c.id)
                    self._killed.discard(c.id)
                if root is not None and not s.keep_workspaces:
                    if os.geteuid() != 0:
                        await self._chown_back(req, root)
                    await anyio.to_thread.run_sync(_rmtree, root)

    async def _copy_out(self, c: Any, path: str, dest: Path) -> None:
        """Copy ``path`` (file or folder) out of the stopped container into ``dest``; best effort, for inspection."""
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                tar = await c.get_archive(path)
            dest.mkdir(parents=True, exist_ok=True)
            with tar:
                await anyio.to_thread.run_sync(lambda: tar.extractall(dest, filter="data"))
        except (aiodocker.DockerError, aiohttp.ClientError, TimeoutError, OSError, tarfile.TarError) as e:
            # A harness that failed early may not have written its transcript at all.
            log.warning("transcript_copy_failed", container=c.id[:12], path=path, error=str(e))

    async def _verify(
        self, req: RolloutRequest, task: Task, root: Path, containers: list[Any]
    ) -> tuple[float, dict[str, float], str] | str:
        """Run tests/test.sh in a fresh container over the workspace: (reward, parts, output) or an error."""
        import aiodocker

        s = self.settings
        tests, logs = root / "tests", root / "logs"
        shutil.copytree(task.tests_dir, tests, symlinks=True)
        shutil.rmtree(logs, ignore_errors=True)
        (logs / "verifier").mkdir(parents=True)
        logs.chmod(0o777)
        (logs / "verifier").chmod(0o777)
        timeout = task.config.verifier.timeout_sec
        config = {
            "Image": s.verifier_image or IMAGES["oracle"],
            "Cmd": ["bash", "-c", ("bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1; rc=$?; "
                                   "cat /logs/verifier/test-stdout.txt; exit $rc")],
            "Env": [f"{k}={v}" for k, v in task.config.verifier.env.items()],
            "WorkingDir": "/app",
            "Labels": self._labels(req, "verifier"),
            "HostConfig": self._host_config([f"{root / 'app'}:/app", f"{tests}:/tests:ro", f"{logs}:/logs"], "none"),
        }
        try:
            c = await self._create_start(config, {}, containers)
        except (aiodocker.DockerError, TimeoutError) as e:
            return f"could not start the verifier container ({config['Image']}): {e}"
        try:
            timed_out, state = await self._wait(c, timeout)
        except _Gone as e:
            return f"verifier container failed: {e}"
        out = await self._logs(c)
        await self._remove(c.id)
        if timed_out:
            return f"test.sh timed out after {timeout:g}s\n{out}"
        try:
            reward, parts = read_reward(logs / "verifier")
        except (RewardError, OSError) as e:
            return f"{e} (test.sh exit code {state.get('ExitCode')})\n{out}"
        return reward, {**parts, "rule": reward}, out

    async def _chown_back(self, req: RolloutRequest, root: Path) -> None:
        """Files the container's root wrote are root-owned on the host; hand them back so they can be removed."""
        import aiodocker

        config = {
            "Image": IMAGES["oracle"],
            "Cmd": ["chown", "-R", f"{os.getuid()}:{os.getgid()}", "/x"],
            "Labels": self._labels(req, "cleanup"),
            "HostConfig": self._host_config([f"{root}:/x"], "none"),
        }
        owned: list[Any] = []
        try:
            c = await self._create_start(config, {}, owned)
            with anyio.fail_after(self.settings.api_timeout_s):
                await c.wait()
        except (aiodocker.DockerError, aiohttp.ClientError, TimeoutError) as e:  # best effort: the dir stays
            log.warning("chown_back_failed", root=str(root), error=str(e))
        finally:
            for c in owned:
                await self._remove(c.id)


def make_backend(kind: Literal["local", "docker"], settings: LocalSettings | DockerSettings | None = None, *,
                 run_id: str = "") -> LocalBackend | DockerBackend:
    """The backend for a config's ``sandbox.backend`` value (settings of the matching type, or None)."""
    want = {"local": (LocalBackend, LocalSettings), "docker": (DockerBackend, DockerSettings)}.get(kind)
    if want is None:
        raise ValueError(f"sandbox backend must be 'local' or 'docker', got {kind!r}")
    cls, settings_cls = want
    if settings is not None and not isinstance(settings, settings_cls):
        raise TypeError(f"the {kind} backend takes {settings_cls.__name__}, got {type(settings).__name__}")
    return cls(settings, run_id=run_id)
