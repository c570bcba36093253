"""Task images for the Docker backend: each task's own environment, built offline, with a harness laid over it.

A task runs in its own image, as Harbor runs it (docs/rollout.md, "Task images"):

- ``[environment] docker_image`` names a local image to use as it is;
- else ``environment/Dockerfile`` is built, with ``environment/`` as its context, and tagged
  ``bridle-task:<key>``: the key hashes the Dockerfile, every file of the context (path, mode, content) and the ids
  of the images it builds on, so an unchanged task is never built twice (the image is found by its tag). Builds
  never pull: every image the Dockerfile names (:mod:`~pipeline.rollout.sandbox.dockerfile`) must be on this
  machine, else a missing one is replaced by its ``[sandbox.docker] base_images`` entry when it has one (logged),
  else the build is refused with an error naming the image and how to provide it. ``RUN`` steps get
  ``build_network``;
- else (no Dockerfile) the task runs in the base image with ``environment/app/`` as its workspace.

The workspace is the image's ``WORKDIR`` (``/app`` when it sets none): its content is copied out of the image once
per image id into a cache (a helper container from the image, which also notes whether the image has ``python3``
and ``bash``), then into each rollout's workspace folder, which is bind-mounted back at the same path.

A harness's payload (what its image adds to the base image, ``Harness.payload``, and the forwarder) is copied out of
its image once per image id into a host folder that containers mount read-only at ``PAYLOAD_MOUNT``: the task's
image is never changed or rebuilt per harness (a derived image per task and harness would store the payload once per
task: hundreds of megabytes each for the Node harnesses), and one copy serves every task. A Node harness's payload
also holds Node's compile cache, filled once as it is copied (``DockerBackend.fill_compile_cache``) and read by every
rollout (``NODE_COMPILE_CACHE``, read-only).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from pipeline.core.logs import get_logger
from pipeline.rollout.harnesses import BASE_IMAGE, FORWARDER, Harness
from pipeline.rollout.images import cache_dir
from pipeline.rollout.sandbox.base import SandboxError
from pipeline.rollout.sandbox.container import DockerEngine, TaskImage
from pipeline.rollout.sandbox.dockerfile import DockerfileError, base_images, substitute
from pipeline.rollout.sandbox.util import rmtree
from pipeline.rollout.tasks import Task
from pipeline.rollout.untrusted import printable

log = get_logger(component="task_images")

KEY_VERSION = "bridle-task-image-1"
TASK_REPO = "bridle-task"
DEFAULT_WORKDIR = "/app"  # the workspace of an image that sets no WORKDIR (or "/")
# What a failed lookup or connection looks like in apt, curl, wget, pip, uv, Python and glibc output.
NETWORK_FAILURE = re.compile(
    rb"temporary failure (?:resolving|in name resolution)|could not resolve host|name or service not known"
    rb"|failed to lookup address|dns error|no address associated with hostname|unable to resolve host"
    rb"|network is unreachable|failed to establish a new connection",
    re.IGNORECASE,
)

# Run in a helper container from the task image as root: copy the WORKDIR ($1) out, note python3 and bash, hand the
# copy to bridle's uid:gid ($2).
_UNPACK = ('set -e; mkdir -p /out/ws; if [ -d "$1" ]; then cp -a "$1/." /out/ws/; fi; '
           'command -v python3 > /out/python3 || true; command -v bash > /out/bash || true; chown -R "$2" /out')
# Run in a helper container from a harness image as root: copy the paths ($2...) out below /out, for uid:gid $1.
_PAYLOAD = 'set -e; u="$1"; shift; cp -a --parents "$@" /out/; chown -R "$u" /out'


class TaskImageError(Exception):
    """A task's image cannot be had (a missing base image, a failed build, an unreadable workspace)."""


def network_failure(output: bytes) -> bool:
    """Whether ``output`` (a build's or test.sh's) shows a failed name lookup or connection. Only this boolean
    is used: the output itself is never quoted."""
    return NETWORK_FAILURE.search(output) is not None


def context_key(env_dir: Path, dockerfile: str, base_ids: list[str]) -> str:
    """The build's key: the Dockerfile as built, every other file of the context (path, mode, content or link
    target), the base images' ids."""
    h = hashlib.sha256(f"{KEY_VERSION}\n{dockerfile}\n{' '.join(base_ids)}\n".encode())
    for p in sorted(env_dir.rglob("*")):
        rel = p.relative_to(env_dir).as_posix()
        if rel == "Dockerfile":
            continue
        st = p.lstat()
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode):o}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            with p.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:24]


def write_context(env_dir: Path, dockerfile: str, dest: Path) -> None:
    """A tar of ``env_dir`` with ``dockerfile`` as its Dockerfile (the task's own file is not changed)."""
    data = dockerfile.encode()
    with tarfile.open(dest, "w") as tar:
        for p in sorted(env_dir.rglob("*")):
            rel = p.relative_to(env_dir).as_posix()
            if rel != "Dockerfile":
                tar.add(p, arcname=rel, recursive=False)
        info = tarfile.TarInfo("Dockerfile")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))


def _build_error(body: str) -> tuple[str, bool]:
    """(the engine's last error, whether the build output shows a network failure) from a /build answer."""
    errors = []
    for line in body.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("error"):
            errors.append(str(obj["error"]))
    return (printable(errors[-1])[-800:] if errors else ""), network_failure(body.encode())


def _workdir(info: dict[str, Any]) -> str:
    wd = (info.get("Config") or {}).get("WorkingDir") or ""
    return wd.rstrip("/") if wd.startswith("/") and wd.rstrip("/") else DEFAULT_WORKDIR


class TaskImages:
    """Resolves tasks to images and harnesses to payloads for one :class:`DockerBackend` (its engine client and
    helper containers); concurrent rollouts of one task build and copy once."""

    def __init__(self, backend: DockerEngine):
        self.backend = backend
        self.settings = backend.settings
        self._locks: defaultdict[str, anyio.Lock] = defaultdict(anyio.Lock)

    @property
    def cache(self) -> Path:
        return cache_dir()

    async def _inspect(self, ref: str) -> dict[str, Any] | None:
        import aiodocker

        try:
            with anyio.fail_after(self.settings.api_timeout_s):
                return await self.backend.docker.images.inspect(ref)
        except aiodocker.DockerError as e:
            if e.status == 404:
                return None
            raise TaskImageError(f"the Docker engine failed to inspect {ref}: {e}") from None
        except TimeoutError:
            raise TaskImageError(f"the Docker engine did not answer within {self.settings.api_timeout_s:g}s") from None

    # ------------------------------------------------------------------------------------------- tasks
    async def resolve(self, task: Task) -> TaskImage:
        """The task's image (built when needed) and its workspace's starting content. Raises TaskImageError."""
        env = task.config.environment
        built = False
        compose = [n for n in ("docker-compose.yaml", "docker-compose.yml") if (task.environment_dir / n).is_file()]
        if compose:
            raise TaskImageError(f"task {task.id}: environment/{compose[0]} (an environment of several containers) is "
                                 "not supported; bridle runs each task in one container from environment/Dockerfile")
        if env.docker_image:
            ref = env.docker_image
            info = await self._inspect(ref)
            if info is None:
                raise TaskImageError(
                    f"task {task.id}: [environment] docker_image = {ref!r} is not on this machine, and bridle does not "
                    f"pull images; load it (`docker load -i FILE`) or build it here and tag it {ref}")
        elif task.dockerfile is not None:
            ref, info, built = await self._build(task)
        else:
            ref = BASE_IMAGE
            info = await self._inspect(ref)
            if info is None:
                raise TaskImageError(f"the base image {ref} is missing; build it with `python run.py --build-images`")
        workdir = _workdir(info)
        ws, probe = await self._unpack(ref, info["Id"], workdir)
        return TaskImage(ref=ref, image_id=info["Id"], workdir=workdir, workspace=ws,
                         seed=not env.docker_image and task.dockerfile is None, python3=probe["python3"],
                         bash=probe["bash"], built=built)

    async def _bases(self, task: Task, text: str) -> tuple[dict[int, str], list[str]]:
        """(instruction index -> substitute image, ids of every base image) for the Dockerfile ``text``."""
        try:
            refs = base_images(text)
        except DockerfileError as e:
            raise TaskImageError(f"{task.dockerfile}: {e}") from None
        replace: dict[int, str] = {}
        ids: list[str] = []
        for r in refs:
            info = await self._inspect(r.image)
            sub = self.settings.base_images.get(r.image, "")
            if info is None and sub:
                info = await self._inspect(sub)
                if info is not None:
                    replace[r.index] = sub
            if info is None:
                also = f", nor is its [sandbox.docker] base_images substitute {sub}" if sub else ""
                raise TaskImageError(
                    f"task {task.id}: environment/Dockerfile line {r.line} ({r.kind}) needs the image {r.image}, which "
                    f"is not on this machine{also}; bridle builds offline (it never pulls). Provide it: `docker load "
                    f"-i FILE` (saved with `docker save` where a registry is reachable), or tag a local image with "
                    f"that name (`docker tag IMAGE {r.image}`), or map it to a local image in [sandbox.docker] "
                    "base_images")
            ids.append(info["Id"])
        return replace, ids

    async def _build(self, task: Task) -> tuple[str, dict[str, Any], bool]:
        assert task.dockerfile is not None
        text = await anyio.to_thread.run_sync(task.dockerfile.read_text)
        replace, ids = await self._bases(task, text)
        text = substitute(text, replace)
        key = await anyio.to_thread.run_sync(context_key, task.environment_dir, text, ids)
        tag = f"{TASK_REPO}:{key}"
        async with self._locks[tag]:
            info = await self._inspect(tag)
            if info is not None:
                return tag, info, False
            await self._engine_build(task, text, tag, key)
            if replace:
                log.info("task_image_substituted_base", task=task.id, substitutes=sorted(set(replace.values())))
            info = await self._inspect(tag)
        if info is None:
            raise TaskImageError(f"task {task.id}: the engine built environment/Dockerfile but {tag} is not there")
        return tag, info, True

    async def _engine_build(self, task: Task, dockerfile: str, tag: str, key: str) -> None:
        limit_s = task.config.environment.build_timeout_sec
        params = {"t": tag, "labels": json.dumps({"bridle.task-key": key, "bridle.task": task.id[:200]}),
                  "networkmode": self.settings.build_network, "rm": "1", "forcerm": "1", "q": "1"}
        log.info("task_image_build", task=task.id, tag=tag)
        with tempfile.TemporaryDirectory(prefix="bridle-taskctx-") as tmp:
            ctx = Path(tmp) / "context.tar"
            await anyio.to_thread.run_sync(write_context, task.environment_dir, dockerfile, ctx)
            try:
                with anyio.fail_after(limit_s), ctx.open("rb") as f:
                    async with self.backend.docker._query(
                        "build", "POST", params=params, data=f, headers={"content-type": "application/x-tar"},
                        timeout=aiohttp.ClientTimeout(total=None)) as resp:
                        body = await resp.text()
            except TimeoutError:
                raise TaskImageError(f"task {task.id}: building environment/Dockerfile took longer than its "
                                     f"[environment] build_timeout_sec = {limit_s:g}") from None
        error, offline = _build_error(body)
        if error or resp.status >= 400:
            hint = ""
            if offline and self.settings.build_network == "none":
                hint = ("; the build's output shows a failed network lookup, and builds have no network "
                        '([sandbox.docker] build_network = "none")')
            raise TaskImageError(f"task {task.id}: building environment/Dockerfile failed: "
                                 f"{error or f'HTTP {resp.status}'}{hint}")

    async def _unpack(self, ref: str, image_id: str, workdir: str) -> tuple[Path, dict[str, bool]]:
        """(the WORKDIR's content, {python3, bash}) of the image, from the cache or a helper container."""
        dest = self.cache / "task-workspaces" / image_id.removeprefix("sha256:")[:32]
        probe = dest / "probe.json"
        async with self._locks[f"unpack:{dest}"]:
            if not await anyio.Path(probe).is_file():
                out = await self._helper(ref, ["sh", "-c", _UNPACK, "sh", workdir, f"{os.getuid()}:{os.getgid()}"],
                                         dest, what=f"copy the workspace ({workdir}) out of the task image {ref}")
                await anyio.to_thread.run_sync(_publish_workspace, out, dest)
        return dest / "ws", json.loads(await anyio.Path(probe).read_text())

    # ----------------------------------------------------------------------------------------- payloads
    async def payload(self, harness: Harness) -> Path:
        """The host folder holding ``harness``'s payload and the forwarder below their image paths."""
        image = self.settings.images.get(harness.name) or harness.image
        info = await self._inspect(image)
        if info is None:
            raise TaskImageError(f"the {harness.name} harness's image {image} is missing; build it with `python run.py "
                                 "--build-images`")
        # "-cc": with Node's compile cache filled (payloads copied before it existed are copied again)
        name = f"{harness.name}-{info['Id'].removeprefix('sha256:')[:32]}{'-cc' if harness.needs_node else ''}"
        dest = self.cache / "payloads" / name
        async with self._locks[f"payload:{dest}"]:
            if not await anyio.Path(dest).is_dir():
                paths = [*harness.payload, FORWARDER]
                out = await self._helper(image, ["sh", "-c", _PAYLOAD, "sh", f"{os.getuid()}:{os.getgid()}", *paths],
                                         dest, what=f"copy the {harness.name} harness out of {image}")
                if harness.needs_node:
                    try:
                        await self.backend.fill_compile_cache(harness, out)
                    except BaseException:
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(rmtree, out)
                        raise
                await anyio.to_thread.run_sync(_publish, out, dest)
        return dest

    async def _helper(self, image: str, cmd: list[str], dest: Path, *, what: str) -> Path:
        """Run ``cmd`` as root in a helper container from ``image`` with a fresh folder beside ``dest`` at /out;
        return that folder once the command succeeded."""
        import aiodocker

        out = await anyio.to_thread.run_sync(_fresh_beside, dest)
        b = self.backend
        config = {
            "Image": image, "Entrypoint": [], "Cmd": cmd, "User": "0:0", "WorkingDir": "/",
            "Labels": b._labels_for("", "helper"),
            "HostConfig": {**b._host_config([f"{out}:/out"], "none"), "CapDrop": ["ALL"],
                           "CapAdd": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]},
        }
        owned: list[Any] = []
        try:
            c = await b._create_start(config, {}, owned)
            timed_out, state = await b._wait(c, 600.0)
            logs = await b._logs(c)
        except (aiodocker.DockerError, TimeoutError, SandboxError) as e:
            await anyio.to_thread.run_sync(rmtree, out)
            raise TaskImageError(f"could not {what}: {e}") from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(rmtree, out)
            raise
        finally:
            for c in owned:
                await b._remove(c.id)
        if timed_out or state.get("ExitCode") != 0:
            await anyio.to_thread.run_sync(rmtree, out)
            raise TaskImageError(f"could not {what}: the helper container "
                                 f"{'timed out' if timed_out else 'exited with ' + str(state.get('ExitCode'))}: "
                                 f"{printable(logs)[-500:]}")
        return out


def _fresh_beside(dest: Path) -> Path:
    """A new empty folder next to ``dest`` (so that moving it there is a rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))


def _publish_workspace(out: Path, dest: Path) -> None:
    """Record what the helper found (python3, bash) and move the copy into place."""
    probe = {k: bool((out / k).read_text().strip()) for k in ("python3", "bash")}
    (out / "probe.json").write_text(json.dumps(probe))
    _publish(out, dest)


def _publish(tmp: Path, dest: Path) -> None:
    """Move a finished copy into place (readable by every uid: containers mount it); another process's copy that
    got there first wins."""
    tmp.chmod(0o755)
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
