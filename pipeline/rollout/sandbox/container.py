"""What the Docker backend's parts share: its settings, a rollout's sandbox, what a task's containers run from and
under, and the engine calls every container goes through (:class:`DockerEngine`: create and start, wait, kill, logs,
remove, labels, limits).

The backend (``docker.py``), the task images (``task_images.py``) and the verifier (``docker_verify.py``) import
this module, never each other's.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.rollout.sandbox.base import CLEANUP_TIMEOUT_S, Sandbox, SandboxError
from pipeline.rollout.sandbox.util import parse_size, tail, tar_files
from pipeline.rollout.sandbox.warm import CreationGate
from pipeline.rollout.tasks import Task

log = get_logger(component="sandbox")

LABEL = "bridle.sandbox"


class DockerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Docker backend: one container per rollout, limits enforced by the engine."""

    # cpus, memory, pids: for a task that gives none in its [environment], and the most one may ask (capped here).
    cpus: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    memory: str = "2g"  # hard limit (swap included); the kernel OOM-kills the harness above it
    pids: Annotated[int, msgspec.Meta(gt=0)] = 512  # processes in the container, at most
    # The agent's network, whatever the task's allow_internet says. none: loopback only, the proxy through the
    # mounted socket + forwarder; bridge: also the outside network; host: the host's network namespace, the harness
    # uses proxy_url directly (no isolation).
    network: Literal["none", "host", "bridge"] = "none"
    # test.sh's network. Harbor tasks' test.sh often installs its tools (apt, uv, pip) from the internet; a task
    # whose tests need none is safer with "none" (workspace code that test.sh runs gets the network too).
    verifier_network: Literal["bridge", "none"] = "bridge"
    build_network: Literal["bridge", "none"] = "bridge"  # RUN steps of task Dockerfiles
    # An image a task Dockerfile names that is not on this machine -> a local image built from instead (logged).
    base_images: dict[str, str] = msgspec.field(
        default_factory=lambda: {"debian:bookworm-slim": "bridle-rootfs:bookworm"})
    images: dict[str, str] = msgspec.field(default_factory=dict)  # harness name -> image its payload comes from
    verifier_image: str = ""  # default: the task's image
    forward_port: int = 8080  # the forwarder's port on the container's loopback
    # The harness's numeric "uid:gid", never root. Default: 65534:65534 (nobody) when bridle runs as root, else
    # bridle's own uid and gid (a non-root bridle cannot give the workspace to another uid).
    user: str = ""
    storage: str = "10g"  # the workspace's size cap when the task's [environment] storage gives none
    file_size: str = "2g"  # RLIMIT_FSIZE, the largest file the harness may write (at most the storage cap)
    open_files: Annotated[int, msgspec.Meta(gt=0)] = 4096  # RLIMIT_NOFILE
    tmp_size: str = "512m"  # the /tmp tmpfs (and each Harness.writable folder); RAM, counted within `memory`
    home_size: str = "512m"  # the HOME tmpfs; RAM, counted within `memory`
    storage_check_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0  # how often the workspace is measured meanwhile
    docker_url: str = ""  # default: DOCKER_HOST, then the local socket
    api_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0  # any one Docker API call


    def problem(self, where: str) -> str:
        """What in these settings cannot work anywhere ("" when nothing): a size that does not parse or is 0; a
        root or malformed user. What this machine cannot give is :meth:`machine_problem`'s."""
        from pipeline.rollout.sandbox.hardening import parse_user

        try:
            parse_user(self.user)
            for field in ("memory", "storage", "file_size", "tmp_size", "home_size"):
                if not parse_size(getattr(self, field), f"{where} {field}"):
                    return f"{where} {field} = {getattr(self, field)!r}: a size must be more than 0"
        except ValueError as e:
            return str(e).replace("[sandbox.docker]", where)
        return ""

    def machine_problem(self, where: str) -> str:
        """A limit over what this machine has: more memory or cores than it has ("" when none). Checked before a
        run starts (pipeline/cli/preflight.py), not when the file is read: a file may be written for another
        machine."""
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if parse_size(self.memory, f"{where} memory") > ram:
            return f"{where} memory = {self.memory!r} is more than this machine's {ram / (1 << 30):.1f} GiB"
        if self.cpus > (os.cpu_count() or 1):
            return (f"{where} cpus = {self.cpus:g}: this machine has {os.cpu_count()} cores; a task asks at most this "
                    f"many, so {os.cpu_count()} or fewer")
        return ""


@dataclass(frozen=True)
class TaskImage:
    """The image a task's rollouts run in, and what bridle learned about it."""

    ref: str  # what containers are created from (the bridle-task tag, docker_image, or the base image)
    image_id: str
    workdir: str  # the workspace's path in the container
    workspace: Path  # the WORKDIR's starting content (a cache; copy it, never write to it)
    seed: bool  # also copy environment/app/ into the workspace (a task with neither Dockerfile nor docker_image)
    python3: bool
    bash: bool
    built: bool  # this call built it (else it was already there)


@dataclass(frozen=True)
class TaskLimits:
    """What the task's containers are held to: the task's [environment] values, capped by the settings."""

    cpus: float
    memory: int  # bytes
    pids: int
    notes: tuple[str, ...]  # each cap applied, in words


@dataclass(kw_only=True)
class DockerSandbox(Sandbox):
    config: dict[str, Any] = field(default_factory=dict)  # the harness container's create request
    containers: list[Any] = field(default_factory=list)  # every container made for this rollout; cleanup removes
    container: Any = None  # the harness's, once created
    started_at: float = 0.0  # when its creation was asked for (the engine's events are searched from here)
    limits: list[tuple[Path, int, str]] = field(default_factory=list)  # (host folder, size cap, what it is)
    over_limit: str = ""  # why the disk watch stopped the harness
    image: TaskImage | None = None  # the task's image, once resolved
    task_limits: TaskLimits | None = None  # cpus / memory / pids of its containers
    go: tuple[list[str], dict[str, str]] | None = None  # from a warm pool: the launch its waiter is handed


def task_limits(task: Task, *, cpus: float, memory: int, pids: int) -> TaskLimits:
    """The task's cpus / memory (or memory_mb) / pids where it gives them, else the settings'; a value above its
    setting is capped there (the settings are what one sandbox may take on this machine) and said in a note."""
    env = task.config.environment
    where = f"{task.root / 'task.toml'}: [environment] memory"
    asked_mem = parse_size(env.memory, where) if env.memory else (env.memory_mb << 20 if env.memory_mb else None)
    notes: list[str] = []

    def capped(name: str, asked: Any, limit: Any, shown: str) -> Any:
        if asked is None:
            return limit
        if asked > limit:
            notes.append(f"task asks {name} = {asked if name != 'memory' else env.memory or env.memory_mb}; capped at "
                         f"[sandbox.docker] {name} = {shown}")
            return limit
        return asked

    return TaskLimits(cpus=capped("cpus", env.cpus, cpus, f"{cpus:g}"),
                      memory=capped("memory", asked_mem, memory, f"{memory >> 20}m"),
                      pids=capped("pids", env.pids, pids, str(pids)), notes=tuple(notes))


def bind_mounts(binds: list[str]) -> list[dict[str, Any]]:
    """``SRC:DST[:ro]`` as the engine's bind mounts. Mounts, not Binds: for a source that does not exist, Binds
    makes a root-owned folder in its place (a container created as a run exits, its proxy socket already removed,
    left one in /tmp); a mount fails instead."""
    out = []
    for b in binds:
        spec, ro = (b[:-3], True) if b.endswith(":ro") else (b, False)
        src, _, dst = spec.rpartition(":")  # the target is a container path without ':'; the source may have one
        out.append({"Type": "bind", "Source": src, "Target": dst, "ReadOnly": ro})
    return out


class DockerEngine:
    """The engine calls of the Docker backend (a mixin: :class:`~pipeline.rollout.sandbox.docker.DockerBackend`
    sets the attributes). Every container is labelled, owned by a list its caller removes, and bounded in time."""

    settings: DockerSettings
    docker: Any  # aiodocker.Docker, once started
    run_id: str
    host: str
    memory_bytes: int
    _live: set[str]  # containers this backend made and has not removed
    _killed: set[str]  # containers it killed itself
    gate: CreationGate  # the host-wide bound on creations (the backend's)

    async def fill_compile_cache(self, harness: Any, payload: Path) -> None:
        """Fill Node's compile cache in a freshly copied payload (the backend's; see DockerBackend)."""
        raise NotImplementedError

    async def _remove(self, cid: str) -> None:
        import aiodocker

        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
            try:
                await self.docker.containers.container(cid).delete(force=True, v=True)
            except aiodocker.DockerError as e:
                if e.status != 404:
                    log.warning("container_remove_failed", container=cid[:12], error=str(e))
        self._live.discard(cid)

    def _labels_for(self, rollout_id: str, role: str) -> dict[str, str]:
        return {LABEL: "1", "bridle.run": self.run_id, "bridle.rollout": rollout_id, "bridle.role": role,
                "bridle.host": self.host, "bridle.owner": str(os.getpid())}

    def _host_config(self, binds: list[str], network: str, limits: TaskLimits | None = None) -> dict[str, Any]:
        s = self.settings
        cpus, memory, pids = (limits.cpus, limits.memory, limits.pids) if limits else (s.cpus, self.memory_bytes, s.pids)
        return {
            "Mounts": bind_mounts(binds),
            "NetworkMode": network,
            "NanoCpus": int(cpus * 1e9),
            "Memory": memory,
            "MemorySwap": memory,  # no swap beyond the limit
            "PidsLimit": pids,
            "Privileged": False,
            "SecurityOpt": ["no-new-privileges"],
            "CapDrop": ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"],
            "Init": True,  # reap zombies; the harness's exit status becomes the container's
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "4m", "max-file": "1"}},
        }

    async def _create_start(self, config: dict[str, Any], files: dict[str, tuple[bytes, int]],
                            owned: list[Any]) -> Any:
        """Create and start a container; it goes into ``owned`` (the caller removes it) as soon as it exists."""
        async with self.gate.slot():
            # Shielded: a cancellation between the engine creating it and us learning its id would leak it.
            with anyio.CancelScope(shield=True), anyio.fail_after(self.settings.api_timeout_s):
                c = await self.docker.containers.create(config)
                self._live.add(c.id)
                owned.append(c)
            with anyio.fail_after(self.settings.api_timeout_s):
                if files:
                    await c.put_archive("/", tar_files(files))
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
                with anyio.fail_after(self.settings.api_timeout_s):
                    await self._kill(c)
                    await c.wait()
            with anyio.fail_after(self.settings.api_timeout_s):
                info = await c.show()
            return scope.cancelled_caught, info["State"]
        except aiodocker.DockerError as e:
            raise SandboxError(f"the container disappeared or the engine failed: {e}") from None
        except TimeoutError:
            raise SandboxError(f"the Docker engine did not answer within {self.settings.api_timeout_s:g}s") from None

    async def _kill(self, c: Any) -> None:
        """SIGKILL the container (the kill is ours, not from outside)."""
        import aiodocker

        self._killed.add(c.id)
        try:
            await c.kill()
        except aiodocker.DockerError as e:
            if e.status != 409:  # 409: it stopped on its own meanwhile
                raise

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
