"""The Docker sandbox backend: one container per rollout from the harness's image.

Images come from ``pipeline/rollout/images.py`` (the tag is the harness adapter's, or ``DockerSettings.images``).
CPU, memory and pids limits, never privileged, ``no-new-privileges``, network ``none`` by default. The proxy's Unix
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
import shutil
import socket
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.messages import RolloutRequest
from pipeline.rollout.harnesses import BASE_IMAGE, LaunchContext
from pipeline.rollout.sandbox.base import (
    CLEANUP_TIMEOUT_S,
    HarnessExit,
    Sandbox,
    SandboxBackend,
    SandboxError,
    Verdict,
    VerifierError,
)
from pipeline.rollout.sandbox.util import parse_size, rmtree, rollout_dir, tail
from pipeline.rollout.tasks import Task, seed_workspace
from pipeline.rollout.verify import RewardError, read_reward

log = get_logger(component="sandbox")

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
    images: dict[str, str] = msgspec.field(default_factory=dict)  # harness name -> image (default: its adapter's)
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


@dataclass(kw_only=True)
class DockerSandbox(Sandbox):
    config: dict[str, Any] = field(default_factory=dict)  # the harness container's create request
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # path -> (content, mode), copied in first
    containers: list[Any] = field(default_factory=list)  # every container made for this rollout; cleanup removes
    container: Any = None  # the harness's, once created
    started_at: float = 0.0  # when its creation was asked for (the engine's events are searched from here)


class DockerBackend(SandboxBackend[DockerSandbox]):
    """One container per rollout from the harness's image (see module docstring)."""

    kind = "docker"
    sandbox_type = DockerSandbox
    cleanup_timeout_s = 2 * CLEANUP_TIMEOUT_S  # two steps: remove the containers, hand the files back

    def __init__(self, settings: DockerSettings | None = None, *, run_id: str = ""):
        super().__init__(run_id=run_id)
        self.settings = settings or DockerSettings()
        self.memory_limit = self.settings.memory
        self.memory_bytes = parse_size(self.settings.memory, "memory")
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
            "Memory": self.memory_bytes,
            "MemorySwap": self.memory_bytes,  # no swap beyond the limit
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

    async def _wait(self, c: Any, limit_s: float) -> tuple[bool, dict[str, Any]]:
        """(timed out, final State): wait for ``c`` to stop, kill it after ``limit_s``. Raises SandboxError when
        the container disappears or the engine fails."""
        import aiodocker

        try:
            with anyio.move_on_after(limit_s) as scope:
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
            raise SandboxError(f"the container disappeared or the engine failed: {e}") from None
        except TimeoutError:
            raise SandboxError(f"the Docker engine did not answer within {self.settings.api_timeout_s:g}s") from None

    async def _logs(self, c: Any) -> str:
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                lines = await c.log(stdout=True, stderr=True, tail="200")
            return tail("".join(lines))
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

    # ------------------------------------------------------------------------------------------------ hooks
    async def prepare(self, box: DockerSandbox) -> None:
        if self.docker is None:
            raise RuntimeError("DockerBackend.run() before start(); call `await backend.start()` first")
        # In a worker thread: seeding the workspace copies files, which must not stall the other rollouts.
        await anyio.to_thread.run_sync(self._lay_out, box)

    def _lay_out(self, box: DockerSandbox) -> None:
        s, h, task = self.settings, box.harness, box.task
        if s.network != "host" and not (box.proxy_socket and Path(box.proxy_socket).exists()):
            raise SandboxError(f"network {s.network!r} reaches the proxy through its Unix socket, but "
                               f"proxy_socket={box.proxy_socket!r} does not exist; set ProxySettings.unix_socket "
                               "(or DockerSettings.network='host')")
        box.root = root = rollout_dir(s.workdir, box.req.rollout_id)
        ws = root / "app"
        seed_workspace(task, ws)
        ws.chmod(0o777)  # the harness may run as any user inside the container
        if h.needs_solution:
            sol = task.root / "solution"
            for p in sol.rglob("*"):
                if p.is_file():
                    box.files[f"/solution/{p.relative_to(sol).as_posix()}"] = (p.read_bytes(), 0o755)
        base_url = box.proxy_url.rstrip("/") if s.network == "host" else f"http://127.0.0.1:{s.forward_port}"
        ctx = LaunchContext(workspace="/app", home="/root", base_url=base_url, token=box.req.token,
                            instruction=task.instruction, model=s.model, max_turns=s.max_turns,
                            binary=h.container_binary, node=h.container_node, python="python3",
                            solution_dir="/solution" if h.needs_solution else "", whitebox_args=list(s.whitebox_args))
        box.launch = launch = h.launch(ctx, box.variant)
        for path, content in launch.files.items():
            box.files[path] = (content.encode(), 0o644)
        cmd, binds = launch.argv, [f"{ws}:/app"]
        if s.network != "host":
            cmd = ["python3", "/opt/bridle/forwarder.py", "--listen", f"127.0.0.1:{s.forward_port}",
                   "--socket", CONTAINER_SOCKET, "--", *cmd]
            binds.append(f"{Path(box.proxy_socket).resolve()}:{CONTAINER_SOCKET}")
        box.config = {
            "Image": s.images.get(h.name) or h.image,
            "Cmd": cmd,
            "Env": [f"{k}={v}" for k, v in launch.env.items()],
            "WorkingDir": "/app",
            "Labels": self._labels(box.req, "harness"),
            "HostConfig": self._host_config(binds, s.network),
        }

    async def launch(self, box: DockerSandbox) -> None:
        import aiodocker

        box.started_at = time.time()
        try:
            box.container = await self._create_start(box.config, box.files, box.containers)
        except aiodocker.DockerError as e:
            hint = "; build the images with `python run.py --build-images`" if e.status == 404 else ""
            raise SandboxError(f"could not start the container ({box.config['Image']}): {e}{hint}") from None
        except TimeoutError:
            raise SandboxError(f"Docker did not start the container within {self.settings.api_timeout_s:g}s") from None

    async def wait(self, box: DockerSandbox, timeout_s: float) -> HarnessExit:
        c = box.container
        timed_out, state = await self._wait(c, timeout_s)
        exit_code = state.get("ExitCode")
        outside = not timed_out and exit_code == 137 and await self._killed_from_outside(c, box.started_at)
        return HarnessExit(timed_out=timed_out, exit_code=exit_code, out_of_memory=bool(state.get("OOMKilled")),
                           killed_from_outside=outside)

    async def logs(self, box: DockerSandbox) -> str:
        return await self._logs(box.container) if box.container is not None else ""

    async def release(self, box: DockerSandbox) -> None:
        assert box.launch is not None and box.root is not None
        if self.settings.keep_workspaces and box.launch.transcript:
            await self._copy_out(box.container, box.launch.transcript, box.root / "home")
        await self._remove(box.container.id)

    async def verify(self, box: DockerSandbox) -> Verdict:
        """Run tests/test.sh in a fresh container over the workspace, with tests/ read-only."""
        import aiodocker

        assert box.root is not None
        root, task = box.root, box.task
        tests, logs = await anyio.to_thread.run_sync(_verifier_dirs, root, task)
        timeout = task.config.verifier.timeout_sec
        config = {
            "Image": self.settings.verifier_image or BASE_IMAGE,
            "Cmd": ["bash", "-c", ("bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1; rc=$?; "
                                   "cat /logs/verifier/test-stdout.txt; exit $rc")],
            "Env": [f"{k}={v}" for k, v in task.config.verifier.env.items()],
            "WorkingDir": "/app",
            "Labels": self._labels(box.req, "verifier"),
            "HostConfig": self._host_config([f"{root / 'app'}:/app", f"{tests}:/tests:ro", f"{logs}:/logs"], "none"),
        }
        try:
            c = await self._create_start(config, {}, box.containers)
        except (aiodocker.DockerError, TimeoutError) as e:
            raise VerifierError(f"could not start the verifier container ({config['Image']}): {e}") from None
        try:
            timed_out, state = await self._wait(c, timeout)
        except SandboxError as e:
            raise VerifierError(f"verifier container failed: {e}") from None
        out = await self._logs(c)
        await self._remove(c.id)
        if timed_out:
            raise VerifierError(f"test.sh timed out after {timeout:g}s\n{out}")
        try:
            reward, parts = read_reward(logs / "verifier")
        except (RewardError, OSError) as e:
            raise VerifierError(f"{e} (test.sh exit code {state.get('ExitCode')})\n{out}") from None
        return Verdict(reward=reward, rewards={**parts, "rule": reward}, output=out)

    async def cleanup(self, box: DockerSandbox) -> None:
        for c in box.containers:
            await self._remove(c.id)
            self._killed.discard(c.id)
        if box.root is not None and not self.settings.keep_workspaces:
            if os.geteuid() != 0:
                await self._chown_back(box.req, box.root)
            await anyio.to_thread.run_sync(rmtree, box.root)

    async def _copy_out(self, c: Any, path: str, dest: Path) -> None:
        """Copy ``path`` (file or folder) out of the stopped container into ``dest``; best effort, for inspection."""
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                tar = await c.get_archive(path)

            def extract() -> None:
                dest.mkdir(parents=True, exist_ok=True)
                tar.extractall(dest, filter="data")

            with tar:
                await anyio.to_thread.run_sync(extract)
        except (aiodocker.DockerError, aiohttp.ClientError, TimeoutError, OSError, tarfile.TarError) as e:
            # A harness that failed early may not have written its transcript at all.
            log.warning("transcript_copy_failed", container=c.id[:12], path=path, error=str(e))

    async def _chown_back(self, req: RolloutRequest, root: Path) -> None:
        """Files the container's root wrote are root-owned on the host; hand them back so they can be removed."""
        import aiodocker

        config = {
            "Image": BASE_IMAGE,
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


def _verifier_dirs(root: Path, task: Task) -> tuple[Path, Path]:
    """(tests, logs) for the verifier container: a fresh copy of the task's tests/, an empty logs/verifier/."""
    tests, logs = root / "tests", root / "logs"
    shutil.copytree(task.tests_dir, tests, symlinks=True)
    shutil.rmtree(logs, ignore_errors=True)
    (logs / "verifier").mkdir(parents=True)
    logs.chmod(0o777)
    (logs / "verifier").chmod(0o777)
    return tests, logs
