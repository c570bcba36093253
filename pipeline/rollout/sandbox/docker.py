"""The Docker sandbox backend: one container per rollout from the task's own image, the harness laid over it.

The task's image (its ``environment/Dockerfile`` built offline, its ``docker_image``, or the base image) and the
harness's payload (copied once out of the harness's image, ``pipeline/rollout/images.py``, and mounted read-only at
``/opt/bridle-harness``) come from ``task_images.py``; the workspace is the image's WORKDIR, copied out and
bind-mounted back. The task's cpus / memory / pids (capped by the settings), never privileged, network ``none`` by
default whatever the task asks; the harness runs as a non-root uid without capabilities on a read-only root
filesystem, its workspace size-capped (``hardening.py`` says exactly what holds). The proxy's Unix socket is
bind-mounted at ``/run/bridle/proxy.sock`` and the forwarder relays ``127.0.0.1:8080`` to it, so the harness
reaches the policy and nothing else. The verifier runs afterwards in a fresh container from the task's image over
the same workspace, on ``verifier_network``, with ``tests/`` mounted read-only (0700: the built-in checker's
uid-65534 child cannot read them; ``docker_verify.py``); the harness never sees the tests, and the host reads only
the reward file, through no link. Containers carry the labels ``bridle.run`` / ``bridle.rollout`` /
``bridle.owner``; :meth:`DockerBackend.start` removes leftovers of this run (containers, rollout directories) and
of runs whose process has died, so a crash never leaks containers; a hard exit removes the live ones
(:meth:`DockerBackend.emergency_stop`). The engine calls every container goes through: ``container.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from pipeline.core.logs import get_logger
from pipeline.core.paths import HARNESS_IMAGES
from pipeline.core.runfiles import strip_setid
from pipeline.core.runtime import on_emergency
from pipeline.messages import RolloutRequest
from pipeline.rollout.harnesses import BASE_IMAGE, FORWARDER, PAYLOAD_MOUNT, Harness, Launch, LaunchContext
from pipeline.rollout.sandbox.base import (
    CLEANUP_TIMEOUT_S,
    HarnessExit,
    SandboxBackend,
    SandboxCommon,
    SandboxError,
    Verdict,
)
from pipeline.rollout.sandbox.container import (
    LABEL,
    DockerEngine,
    DockerSandbox,
    DockerSettings,
    TaskImage,
    TaskLimits,
    task_limits,
)
from pipeline.rollout.sandbox.docker_verify import verify_in_container
from pipeline.rollout.sandbox.hardening import (
    CONTAINER_HOME,
    SEED_MOUNT,
    give_to,
    harness_host_config,
    over_limit,
    parse_user,
    remove_containers_now,
    seeded,
    write_seed,
)
from pipeline.rollout.sandbox.task_images import DEFAULT_WORKDIR, TaskImageError, TaskImages
from pipeline.rollout.sandbox.util import (
    parse_size,
    pid_alive,
    remove_run_dirs,
    rmtree,
    rollout_dir,
    run_prefix,
)
from pipeline.rollout.sandbox.warm import WAIT_EXEC, write_go
from pipeline.rollout.tasks import Task, seed_workspace
from pipeline.rollout.untrusted import printable

log = get_logger(component="sandbox")

CONTAINER_SOCKET = "/run/bridle/proxy.sock"
GO_MOUNT = "/run/bridle/go"  # a pooled container's go/ folder, read-only: where its launch appears
# Node's compile cache in a Node harness's payload: filled once, then read (read-only) by every rollout
COMPILE_CACHE = "node-compile-cache"
COMPILE_CACHE_TIMEOUT_S = 300.0
MODEL_STUB = HARNESS_IMAGES / "base" / "model_stub.py"  # what the harness talks to while the cache fills


@dataclass
class _WarmTemplate:
    """What a pooled container of one key is made from (the first rollout of that key gives it)."""

    image: TaskImage
    harness: Harness
    payload: Path
    proxy_socket: str
    limits: TaskLimits
    storage: int


@dataclass
class _Slot:
    """A pooled container: started, its forwarder listening, its waiter waiting for go/go.json."""

    root: Path  # its folder (app/, seed/, go/, home/ when kept), renamed for the rollout that takes it
    container: Any
    limits: list[tuple[Path, int, str]]  # the size caps to watch (under root)
    created_at: float


class DockerBackend(DockerEngine, SandboxBackend[DockerSandbox]):
    """One container per rollout from the task's image, the harness laid over it (see module docstring)."""

    kind = "docker"
    sandbox_type = DockerSandbox
    cleanup_timeout_s = 2 * CLEANUP_TIMEOUT_S  # two steps: remove the containers, hand the files back
    # Whether this backend is the run's only one on its host: then what it does not hold of its run is a crash's
    # leftover. False where several processes share a run on one host (the Ray backend's per-rollout workers): each
    # removes only containers whose owning process is gone, never its siblings' live ones or their workspaces.
    sole_owner = True

    def __init__(self, settings: DockerSettings | None = None, common: SandboxCommon | None = None, *,
                 run_id: str = ""):
        super().__init__(run_id=run_id)
        self.settings = settings or DockerSettings()
        self.common = common or SandboxCommon()
        self.keep_workspaces = self.common.keep_workspaces
        self.memory_limit = self.settings.memory
        self.memory_bytes = parse_size(self.settings.memory, "memory")
        s = self.settings
        self.user = parse_user(s.user)
        self.storage_bytes = parse_size(s.storage, "[sandbox.docker] storage")
        self.file_bytes = parse_size(s.file_size, "[sandbox.docker] file_size")
        self.tmp_bytes = parse_size(s.tmp_size, "[sandbox.docker] tmp_size")
        self.home_bytes = parse_size(s.home_size, "[sandbox.docker] home_size")
        self._emergency = self.emergency_stop  # one bound method: on_emergency keys on its identity
        self._unregister: Callable[[], None] = lambda: None
        self.docker: Any = None
        self.host = socket.gethostname()
        self._live: set[str] = set()
        self._killed: set[str] = set()
        self.task_images = TaskImages(self)
        self._warm_from(self.common)

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
        self._unregister = on_emergency(self._emergency)

    async def reap(self) -> int:
        """Remove containers of this run, and of runs on this host whose process is gone, and this run's rollout
        directories (unless they are kept): what a crash of this run left."""
        with anyio.fail_after(self.settings.api_timeout_s):
            found = await self.docker.containers.list(all="1", filters=json.dumps({"label": [LABEL]}))
        n = 0
        for c in found:
            labels = c._container.get("Labels") or {}
            mine = self.sole_owner and labels.get("bridle.run") == self.run_id and c.id not in self._live
            orphan = labels.get("bridle.host") == self.host and not pid_alive(int(labels.get("bridle.owner", 0)))
            if mine or orphan:
                await self._remove(c.id)
                n += 1
        dirs = 0 if self.common.keep_workspaces or not self.sole_owner else await self._remove_run_dirs()
        if n or dirs:
            log.warning("reaped_leftovers", run=self.run_id, containers=n, workspaces=dirs)
        return n

    async def _remove_run_dirs(self) -> int:
        if os.geteuid() != 0:  # the verifier's root may have written there
            where = Path(self.common.workdir or tempfile.gettempdir())
            for d in await anyio.to_thread.run_sync(lambda: list(where.glob(f"{run_prefix(self.run_id)}*"))):
                await self._chown_back(d, self._labels_for("", "cleanup"))
        return await anyio.to_thread.run_sync(remove_run_dirs, self.common.workdir, self.run_id)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.pool is not None:  # its folders too
                await self.pool.aclose()
            for cid in list(self._live):
                await self._remove(cid)
            if self.docker is not None:
                with anyio.move_on_after(CLEANUP_TIMEOUT_S):
                    await self.docker.close()
                self.docker = None
        self._unregister()

    def emergency_stop(self) -> None:
        """Synchronously, for a process that exits without cleanup (a second Ctrl-C): remove this run's live
        containers with the docker CLI (the event loop will not run again), then the rollout directories."""
        remove_containers_now(sorted(self._live), self.settings.docker_url)
        if not self.common.keep_workspaces and self.sole_owner:
            remove_run_dirs(self.common.workdir, self.run_id)

    # ------------------------------------------------------------------------------------------ helpers
    def _labels(self, req: RolloutRequest, role: str) -> dict[str, str]:
        return self._labels_for(req.rollout_id, role)

    # ------------------------------------------------------------------------------------------------ hooks
    async def prepare(self, box: DockerSandbox) -> None:
        if self.docker is None:
            raise RuntimeError("DockerBackend.run() before start(); call `await backend.start()` first")
        h, s = box.harness, self.settings
        if s.network != "host" and not (box.proxy_socket and await anyio.Path(box.proxy_socket).exists()):
            raise SandboxError(f"network {s.network!r} reaches the proxy through its Unix socket, but "
                               f"proxy_socket={box.proxy_socket!r} does not exist; set ProxySettings.unix_socket "
                               "(or DockerSettings.network='host')")
        try:
            box.image = await self.task_images.resolve(box.task)
            payload = await self.task_images.payload(h)
        except TaskImageError as e:
            raise SandboxError(str(e)) from None
        if self.pool is not None and box.image.python3 and not h.needs_solution:
            await self._from_pool(box, payload)
            return
        # In a worker thread: seeding the workspace copies files, which must not stall the other rollouts.
        await anyio.to_thread.run_sync(self._lay_out, box, payload)

    def _task_notes(self, box: DockerSandbox) -> TaskLimits:
        s, task = self.settings, box.task
        limits = task_limits(task, cpus=s.cpus, memory=self.memory_bytes, pids=s.pids)
        box.notes.extend(limits.notes)
        if task.config.environment.allow_internet and s.network == "none":
            box.notes.append('the task asks allow_internet = true; not honoured: the agent reaches only the proxy '
                             '([sandbox.docker] network = "none")')
        return limits

    def _storage(self, task: Task) -> int:
        where = f"{task.root / 'task.toml'}: [environment] storage"
        return parse_size(task.config.environment.storage, where) or self.storage_bytes

    def _launch(self, box: DockerSandbox) -> Launch:
        """The harness's launch for this rollout (container paths: the same in a pooled sandbox)."""
        h, c, s, image = box.harness, self.common, self.settings, box.image
        assert image is not None
        base_url = box.proxy_url.rstrip("/") if s.network == "host" else f"http://127.0.0.1:{s.forward_port}"
        ctx = LaunchContext(workspace=image.workdir, home=CONTAINER_HOME, base_url=base_url, token=box.req.token,
                            instruction=box.task.instruction, model=c.model, max_turns=c.max_turns,
                            binary=PAYLOAD_MOUNT + h.container_binary if h.container_binary else "",
                            node=PAYLOAD_MOUNT + h.container_node if h.container_node else "", python="python3",
                            solution_dir="/solution" if h.needs_solution else "", whitebox_args=list(c.whitebox_args))
        box.launch = launch = h.launch(ctx, box.variant)
        if h.needs_node:  # both Node harnesses enable Node's compile cache: theirs is filled ahead, read-only
            launch.env.setdefault("NODE_COMPILE_CACHE", f"{PAYLOAD_MOUNT}/{COMPILE_CACHE}")
        return launch

    async def fill_compile_cache(self, harness: Harness, payload: Path) -> None:
        """Fill ``payload``/node-compile-cache: the harness runs one turn (start-up, a request, the answer "Done."
        from model_stub.py, exit) in a container like a rollout's, network none, with its compile cache there and
        writable. Every rollout then reads it, read-only: what a policy runs can never change the code later
        rollouts load. Best effort: a harness that fails here leaves the cache as far as it got, and says so."""
        cache, seed = payload / COMPILE_CACHE, payload.parent / f".{payload.name}-seed"
        port = self.settings.forward_port
        ctx = LaunchContext(workspace=DEFAULT_WORKDIR, home=CONTAINER_HOME, base_url=f"http://127.0.0.1:{port}",
                            token="compile-cache", instruction="Reply with the word done.", model=self.common.model,
                            max_turns=2, binary=PAYLOAD_MOUNT + harness.container_binary,
                            node=PAYLOAD_MOUNT + harness.container_node, python="python3")
        launch = harness.launch(ctx, "")

        def lay_out() -> bool:
            payload.chmod(0o755)  # as it is once published: the container's uid runs from it
            cache.mkdir()
            seed.mkdir()
            files = write_seed(launch.files, seed, (DEFAULT_WORKDIR, "/tmp", CONTAINER_HOME, *harness.writable))
            give_to(cache, *self.user)
            give_to(seed, *self.user)
            return files

        owned: list[Any] = []
        try:
            argv = seeded(launch.argv) if await anyio.to_thread.run_sync(lay_out) else launch.argv
            binds = [f"{payload}:{PAYLOAD_MOUNT}:ro", f"{cache}:{PAYLOAD_MOUNT}/{COMPILE_CACHE}",
                     f"{seed}:{SEED_MOUNT}:ro", f"{MODEL_STUB}:/run/bridle/model_stub.py:ro"]
            cmd = ["python3", "/run/bridle/model_stub.py", "--listen", f"127.0.0.1:{port}", "--", *argv]
            env = {**launch.env, "NODE_COMPILE_CACHE": f"{PAYLOAD_MOUNT}/{COMPILE_CACHE}"}
            config = self._container(BASE_IMAGE, DEFAULT_WORKDIR, harness, cmd, env, binds, None, self.file_bytes,
                                     self._labels_for("", "helper"), kept_home=False)
            config["HostConfig"]["NetworkMode"] = "none"
            c = await self._create_start(config, {}, owned)
            timed_out, state = await self._wait(c, COMPILE_CACHE_TIMEOUT_S)
            failed = timed_out or state.get("ExitCode") != 0
            output = await self._logs(c) if failed else ""
        finally:
            with anyio.CancelScope(shield=True):
                for c in owned:
                    await self._remove(c.id)
                await anyio.to_thread.run_sync(rmtree, seed)
        n = await anyio.to_thread.run_sync(_share, cache)
        if failed or not n:
            log.warning("compile_cache_partial", harness=harness.name, files=n, timed_out=timed_out,
                        exit_code=state.get("ExitCode"), output=printable(output)[-400:])
        else:
            log.info("compile_cache_filled", harness=harness.name, files=n)

    def _mounts(self, root: Path, image: TaskImage, h: Harness, payload: Path) -> tuple[list[str], list]:
        """The binds every harness container has (workspace, HOME when kept, payload) and the size caps to watch."""
        ws, wd = root / "app", image.workdir
        binds = [f"{ws}:{wd}"]
        limits: list[tuple[Path, int, str]] = [(ws, 0, f"the workspace ({wd})")]  # the cap: the caller's
        if self.common.keep_workspaces:  # HOME on the host, with the transcript in it, instead of a tmpfs
            (root / "home").mkdir(mode=0o700)
            binds.append(f"{root / 'home'}:{CONTAINER_HOME}")
            limits.append((root / "home", self.home_bytes, f"the harness's HOME ({CONTAINER_HOME})"))
        binds.append(f"{payload}:{PAYLOAD_MOUNT}:ro")
        return binds, limits

    def _forwarded(self, cmd: list[str], binds: list[str], h: Harness, image: TaskImage, proxy_socket: str) -> list[str]:
        """``cmd`` behind the forwarder, for every harness the image can run it for (python3), so that every
        sandbox looks the same from inside; a harness that talks to the policy needs it (_check_image)."""
        s = self.settings
        if s.network == "host" or not (h.uses_proxy or image.python3):
            return cmd
        binds.append(f"{Path(proxy_socket).resolve()}:{CONTAINER_SOCKET}")
        return ["python3", PAYLOAD_MOUNT + FORWARDER, "--listen", f"127.0.0.1:{s.forward_port}",
                "--socket", CONTAINER_SOCKET, "--", *cmd]

    def _container(self, ref: str, workdir: str, h: Harness, cmd: list[str], env: dict[str, str], binds: list[str],
                   limits: TaskLimits | None, file_cap: int, labels: dict[str, str],
                   kept_home: bool | None = None) -> dict[str, Any]:
        """A harness container's create request; ``kept_home``: HOME bind-mounted (default: keep_workspaces)."""
        s, c = self.settings, self.common
        kept_home = c.keep_workspaces if kept_home is None else kept_home
        return {
            "Image": ref,
            "Entrypoint": [],  # the task image's own ENTRYPOINT must not wrap the harness
            "Cmd": cmd,
            "User": "{}:{}".format(*self.user),
            "Env": [f"{k}={v}" for k, v in env.items()],
            "WorkingDir": workdir,
            "Labels": labels,
            "HostConfig": {**self._host_config(binds, s.network, limits), **harness_host_config(
                user=self.user, home="" if kept_home else CONTAINER_HOME, writable=h.writable,
                tmp_bytes=self.tmp_bytes, home_bytes=self.home_bytes, open_files=s.open_files,
                file_bytes=min(self.file_bytes, file_cap))},
        }

    def _lay_out(self, box: DockerSandbox, payload: Path) -> None:
        h, task, image = box.harness, box.task, box.image
        assert image is not None
        box.task_limits = limits = self._task_notes(box)
        storage = self._storage(task)
        box.root = root = rollout_dir(self.common.workdir, self.run_id, box.req.rollout_id)
        ws = root / "app"
        shutil.copytree(image.workspace, ws, symlinks=True)
        if image.seed:
            seed_workspace(task, ws)
        binds, box.limits = self._mounts(root, image, h, payload)
        box.limits[0] = (ws, storage, box.limits[0][2])
        if h.needs_solution:
            shutil.copytree(task.root / "solution", root / "solution", symlinks=True)
            binds.append(f"{root / 'solution'}:/solution:ro")
        launch = self._launch(box)
        cmd = self._forwarded(launch.argv, binds, h, image, box.proxy_socket)
        if write_seed(launch.files, root / "seed", (image.workdir, "/tmp", CONTAINER_HOME, *h.writable)):
            cmd = seeded(cmd)
            binds.append(f"{root / 'seed'}:{SEED_MOUNT}:ro")
        _check_image(image, task, h.name, cmd)
        for part in ("app", "home", "seed", "solution"):
            if (root / part).exists():
                give_to(root / part, *self.user)
        box.config = self._container(image.ref, image.workdir, h, cmd, launch.env, binds, limits, storage,
                                     self._labels(box.req, "harness"))

    # ------------------------------------------------------------------------------------------- warm pool
    async def _from_pool(self, box: DockerSandbox, payload: Path) -> None:
        """A pooled container for this rollout (one made now when none is ready), handed the rollout's launch."""
        assert self.pool is not None and box.image is not None
        box.task_limits = limits = self._task_notes(box)
        storage = self._storage(box.task)
        key = (box.image.ref, box.harness.name, box.proxy_socket, limits.cpus, limits.memory, limits.pids, storage)
        template = _WarmTemplate(box.image, box.harness, payload, box.proxy_socket, limits, storage)
        slot = await self.pool.take(key, template)
        if slot is None:
            slot = await self._make_warm(key, template)
        box.containers.append(slot.container)  # from here on the rollout's: its cleanup removes it
        box.container, box.started_at, box.limits = slot.container, slot.created_at, slot.limits
        box.root = slot.root
        await anyio.to_thread.run_sync(self._hand_out, box, slot)

    def _hand_out(self, box: DockerSandbox, slot: _Slot) -> None:
        """The task's part of a pooled sandbox: its folder renamed for the rollout, the task's files, the launch."""
        h, task, image = box.harness, box.task, box.image
        assert image is not None
        root = rollout_dir(self.common.workdir, self.run_id, box.req.rollout_id)
        try:
            os.replace(slot.root, root)  # onto the fresh empty folder; the container's mounts follow the folders
        except OSError:
            root.rmdir()
            raise
        box.root = root
        box.limits = [(root / p.relative_to(slot.root), cap, what) for p, cap, what in slot.limits]
        if image.seed:
            seed_workspace(task, root / "app")
        launch = self._launch(box)
        argv = launch.argv
        if write_seed(launch.files, root / "seed", (image.workdir, "/tmp", CONTAINER_HOME, *h.writable)):
            argv = seeded(argv)
        _check_image(image, task, h.name, argv)
        for part in ("app", "seed"):
            give_to(root / part, *self.user)
        box.go = (argv, launch.env)

    async def _make_warm(self, key: Any, template: _WarmTemplate) -> _Slot:
        t = template
        root = await anyio.to_thread.run_sync(rollout_dir, self.common.workdir, self.run_id, "warm")
        owned: list[Any] = []
        try:
            def lay_out() -> tuple[list[str], list]:
                shutil.copytree(t.image.workspace, root / "app", symlinks=True)
                (root / "seed").mkdir()
                (root / "go").mkdir(mode=0o755)
                binds, limits = self._mounts(root, t.image, t.harness, t.payload)
                binds += [f"{root / 'seed'}:{SEED_MOUNT}:ro", f"{root / 'go'}:{GO_MOUNT}:ro"]
                for part in ("app", "home", "seed"):
                    if (root / part).exists():
                        give_to(root / part, *self.user)
                return binds, limits
            binds, limits = await anyio.to_thread.run_sync(lay_out)
            limits[0] = (limits[0][0], t.storage, limits[0][2])
            cmd = self._forwarded(["python3", "-S", "-c", WAIT_EXEC, GO_MOUNT], binds, t.harness, t.image,
                                  t.proxy_socket)
            config = self._container(t.image.ref, t.image.workdir, t.harness, cmd, {}, binds, t.limits, t.storage,
                                     self._labels_for("", "warm"))
            created_at = time.time()
            container = await self._create_start(config, {}, owned)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for c in owned:
                    await self._remove(c.id)
                await anyio.to_thread.run_sync(rmtree, root)
            raise
        return _Slot(root=root, container=container, limits=limits, created_at=created_at)

    async def _warm_alive(self, slot: _Slot) -> bool:
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                state = (await slot.container.show())["State"]
        except (aiodocker.DockerError, TimeoutError):
            return False
        return bool(state.get("Running")) and not state.get("Restarting") and not state.get("Paused")

    async def _destroy_warm(self, slot: _Slot) -> None:
        with anyio.CancelScope(shield=True):
            await self._remove(slot.container.id)
            await anyio.to_thread.run_sync(rmtree, slot.root)

    async def launch(self, box: DockerSandbox) -> None:
        import aiodocker

        if box.go is not None:  # a pooled container: its waiter becomes the harness
            await anyio.to_thread.run_sync(write_go, box.root / "go", *box.go)
            return
        box.started_at = time.time()
        try:
            box.container = await self._create_start(box.config, {}, box.containers)
        except aiodocker.DockerError as e:
            hint = "; build the images with `python run.py --build-images`" if e.status == 404 else ""
            raise SandboxError(f"could not start the container ({box.config['Image']}): {e}{hint}") from None
        except TimeoutError:
            raise SandboxError(f"Docker did not start the container within {self.settings.api_timeout_s:g}s") from None

    async def wait(self, box: DockerSandbox, timeout_s: float) -> HarnessExit:
        """Also watches the workspace's size (:meth:`_watch_disk`): over the cap, the harness is stopped, or found
        over it once it has ended, and this raises SandboxError."""
        c = box.container
        ended: tuple[bool, dict[str, Any]] | SandboxError
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disk, box)
            try:
                ended = await self._wait(c, timeout_s)
            except SandboxError as e:  # raised out of the task group, it would come wrapped in an ExceptionGroup
                ended = e
            finally:
                tg.cancel_scope.cancel()
        if isinstance(ended, SandboxError):
            raise ended
        timed_out, state = ended
        over = box.over_limit or await anyio.to_thread.run_sync(over_limit, box.limits)
        if over:
            raise SandboxError(f"{over}; the rollout fails (a task's size cap is [environment] storage in its "
                               "task.toml, else [sandbox.docker] storage)")
        exit_code = state.get("ExitCode")
        outside = not timed_out and exit_code == 137 and await self._killed_from_outside(c, box.started_at)
        return HarnessExit(timed_out=timed_out, exit_code=exit_code, out_of_memory=bool(state.get("OOMKilled")),
                           killed_from_outside=outside)

    def memory_limit_of(self, box: DockerSandbox) -> str | None:
        return f"{box.task_limits.memory >> 20}m" if box.task_limits else self.memory_limit

    async def logs(self, box: DockerSandbox) -> str:
        return await self._logs(box.container) if box.container is not None else ""

    async def _watch_disk(self, box: DockerSandbox) -> None:
        """Measure the bind-mounted folders every ``storage_check_s`` while the harness runs; kill it above a cap.
        (RLIMIT_FSIZE bounds one file, not how many there are; the host folder has no quota of its own.)"""
        import aiodocker

        while True:
            await anyio.sleep(self.settings.storage_check_s)
            over = await anyio.to_thread.run_sync(over_limit, box.limits, abandon_on_cancel=True)
            if over:
                box.over_limit = f"{over} while the harness ran, so it was stopped"
                # When the kill fails, the engine failed or the container is gone: _wait reports that.
                with anyio.move_on_after(self.settings.api_timeout_s), suppress(aiodocker.DockerError):
                    await self._kill(box.container)
                return

    async def release(self, box: DockerSandbox) -> None:
        await self._remove(box.container.id)

    async def verify(self, box: DockerSandbox) -> Verdict:
        return await verify_in_container(self, box)

    async def cleanup(self, box: DockerSandbox) -> None:
        for c in box.containers:
            await self._remove(c.id)
            self._killed.discard(c.id)
        if box.root is not None and not self.common.keep_workspaces:
            if os.geteuid() != 0:
                await self._chown_back(box.root, self._labels(box.req, "cleanup"))
            await anyio.to_thread.run_sync(rmtree, box.root)
        elif box.root is not None:
            await anyio.to_thread.run_sync(strip_setid, box.root)

    async def _chown_back(self, root: Path, labels: dict[str, str]) -> None:
        """Files the verifier's root wrote are root-owned on the host; hand them back so they can be removed."""
        import aiodocker

        config = {
            "Image": BASE_IMAGE,
            "Cmd": ["chown", "-R", f"{os.getuid()}:{os.getgid()}", "/x"],
            "Labels": labels,
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


def _share(folder: Path) -> int:
    """Make the files under ``folder`` readable by every uid (the cache is read by whichever uid a sandbox runs as);
    how many there are."""
    n = 0
    for d, _, names in os.walk(folder):
        os.chmod(d, 0o755)
        for name in names:
            os.chmod(os.path.join(d, name), 0o644)
            n += 1
    return n


def _check_image(image: TaskImage, task: Task, harness: str, cmd: list[str]) -> None:
    """Refuse a harness command the task's image cannot run: python3 for the forwarder, the launcher's config files
    and the white-box harness; bash for the oracle's solve.sh."""
    if cmd[0] == "python3" and not image.python3:
        raise SandboxError(f"the task image {image.ref} (task {task.id}) has no python3, which the {harness} harness "
                           "needs in Docker: bridle's forwarder (its only way to the proxy) and launcher are python3 "
                           "scripts; add python3 to the task's environment/Dockerfile")
    if cmd[0] == "bash" and not image.bash:
        raise SandboxError(f"the task image {image.ref} (task {task.id}) has no bash, which runs solution/solve.sh; "
                           "add bash to the task's environment/Dockerfile")
