"""The Ray sandbox backend: each rollout's Docker sandbox on a node of a Ray cluster, placed by Ray.

Per rollout, one Ray task asks for one unit of ``[sandbox.ray] resource`` (a custom resource that each node with a
Docker engine declares, one unit per sandbox it may hold), so Ray's scheduler (and an autoscaler: KubeRay, Slurm)
decides where it runs. On that node the task runs the Docker backend's own template (:mod:`.docker`: the same
image, limits, network ``none`` and hardening) over the task folder it was sent through Ray's object store, and
returns a msgspec-encoded :class:`NodeResult`: the :class:`~pipeline.messages.RolloutFinished` (the verifier's
result), the node it ran on and, with ``keep_workspaces``, the rollout's folder (workspace, HOME with the harness's
transcript) as a tar archive, unpacked on this machine. Nothing goes through a shared disk.

The proxy: every node with the resource gets one :class:`Relay` actor (pinned to it by node affinity) that listens
on a Unix socket in a node-local folder per proxy address (one per ``[proxy] workers``: each worker has its own
port, and a rollout's calls go to the worker that owns it) and relays each connection's bytes to that TCP address;
the socket of the rollout's worker is what its container gets mounted as ``/run/bridle/proxy.sock``, so a container
reaches its proxy worker through its node's relay and nothing else. The rollout token still authenticates every call
at the proxy. Relays are made for the nodes that are there when rollouts start and for nodes that join later (the
node list is read again every ``node_check_s``); a relay listens for a proxy address the first time a rollout needs
it.

The rubric judge (``[sandbox.judge]``) runs here, on the driver: its address and key never reach a node. When the
task has a rubric, the node takes the bounded workspace snapshot the judge reads (:func:`take_snapshot`, the same as
the other backends') after the verifier and sends it back in the :class:`NodeResult`; the driver asks the judge and
mixes the score into the reward as the other backends do (:func:`judged_verdict`).

Node loss: a rollout's task is never retried (``max_retries=0``: a rollout must not run twice against the proxy);
a task whose node or worker died ends as ``sandbox_error`` with Ray's reason, and the run goes on with the nodes
left. Every node needs the bridle package importable by Ray's workers, a Docker engine with the sandbox images
(``python run.py --build-images``) and a route to the proxy's TCP port (``[proxy] host`` / ``port``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import shutil
import tarfile
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec

from pipeline.core.logs import get_logger
from pipeline.core.runfiles import remove_tree, safe_name
from pipeline.core.runtime import run_main
from pipeline.messages import RolloutFinished, RolloutRequest
from pipeline.rollout.judge import Judge, JudgeError, take_snapshot
from pipeline.rollout.sandbox.base import (
    SandboxCommon,
    Verdict,
    VerifierError,
    harness_limit,
    judged,
    judged_verdict,
)
from pipeline.rollout.sandbox.container import DockerSandbox, DockerSettings
from pipeline.rollout.sandbox.docker import DockerBackend
from pipeline.rollout.tasks import Task, TaskError, load_task

log = get_logger(component="sandbox")

INSTALL_HINT = "the ray sandbox backend needs Ray: pip install -e '.[ray]'"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class RaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[sandbox.ray]``: where the cluster is and what a rollout asks of it. The sandboxes' own settings are
    ``[sandbox.docker]``'s (each node runs the Docker backend)."""

    address: str = "auto"  # ray.init's address: "auto" (the cluster this machine joined with `ray start`), host:port
    namespace: str = "bridle"  # the Ray namespace of bridle's actors
    resource: str = "bridle_docker"  # the custom resource of a node with Docker: one unit per sandbox it may hold
    resources: dict[str, float] = msgspec.field(default_factory=dict)  # more per rollout (e.g. a node-type label)
    num_cpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # Ray CPUs per rollout (the container's are Docker's)
    # "spread": each rollout to the next node with a free unit (Ray's SPREAD). "default": Ray's DEFAULT, which
    # prefers the node holding the task's archive (the driver's, where the learner and the engine run) and so
    # fills it first.
    scheduling: Literal["spread", "default"] = "spread"
    # host:port the nodes dial for the proxy. Default: the proxy's own address, a wildcard host ([proxy] host =
    # "0.0.0.0") replaced by this machine's address in the cluster.
    proxy_address: str = ""
    relay_dir: str = ""  # node-local folder for the relays' sockets (default: each node's temp dir)
    workspaces: str = ""  # where kept workspaces come back to here (default: [sandbox] workdir, else temp)
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # ray.init, a relay's start
    # A rollout's task may take its harness limit plus this (image builds, the verifier, transfers), then it is
    # cancelled and the rollout is a sandbox_error.
    overhead_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    node_check_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # how often the node list is read for new nodes
    # A node keeps each task folder it was sent (unpacked once, under its temp dir's bridle-ray-tasks/) until no
    # rollout has used it for this long; longer than any rollout (its harness limit + overhead_s) so that a folder
    # is never removed under one.
    task_cache_idle_s: Annotated[float, msgspec.Meta(gt=0)] = 6 * 3600.0
    # Task archives this driver keeps in Ray's object store for the next rollouts of their tasks (least recently
    # used dropped first; a dropped one is archived and sent again when its task comes back).
    archive_cache: Annotated[int, msgspec.Meta(ge=1)] = 256

    def check(self, where: str) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"{where}: {INSTALL_HINT}")
        if not self.resource:
            raise ValueError(f"{where}.resource: name the custom resource the Docker nodes declare "
                             "(ray start --resources '{\"bridle_docker\": 8}')")
        if self.resource in self.resources:
            raise ValueError(f"{where}.resources: {self.resource!r} is [sandbox.ray] resource itself (one unit per "
                             "rollout); list only other resources")
        if self.proxy_address:
            split_address(self.proxy_address, f"{where}.proxy_address")


class SnapshotSpec(msgspec.Struct, kw_only=True):
    """The judge's workspace snapshot, taken on the node after the verifier (``[sandbox.judge]``'s limits)."""

    max_chars: int
    max_file_chars: int
    timeout_s: float


class NodeJob(msgspec.Struct, kw_only=True):
    """What a rollout's task is sent (beside the task folder's archive)."""

    request: RolloutRequest
    docker: DockerSettings
    common: SandboxCommon
    run_id: str
    relay_dir: str
    proxy_port: int  # the proxy (worker) the rollout talks to: which of its node's relay sockets it gets
    task_hash: str  # the task folder archive's sha256: its node-local copy's folder
    task_name: str  # the folder's own name (a task's id may come from it)
    task_cache_idle_s: float = 6 * 3600.0  # [sandbox.ray] task_cache_idle_s
    snapshot: SnapshotSpec | None = None  # a judge will score the workspace: send its snapshot back


class NodeResult(msgspec.Struct, kw_only=True):
    """What a rollout's task returns."""

    finished: RolloutFinished
    node_id: str
    workspace_name: str = ""  # the rollout folder's name, with keep_workspaces
    workspace: bytes = b""  # its tar archive
    snapshot: str | None = None  # the judge's workspace snapshot, when asked and the verifier gave a reward
    snapshot_error: str = ""  # why there is none (JudgeError's words)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    return ray


def split_address(address: str, where: str) -> tuple[str, int]:
    """``host:port`` as (host, port); ValueError naming ``where`` otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{where}: expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def relay_folder(relay_dir: str, run_id: str, node_id: str) -> Path:
    """The folder of a node's relay sockets (short: a Unix socket's path must stay under 108 bytes)."""
    return Path(relay_dir or tempfile.gettempdir()) / f"bridle-relay-{safe_name(run_id, 24)}-{node_id[:12]}"


def relay_socket(relay_dir: str, run_id: str, node_id: str, port: int) -> Path:
    """The node's relay socket for the proxy (worker) at ``port``."""
    return relay_folder(relay_dir, run_id, node_id) / socket_name(port)


def socket_name(port: int) -> str:
    return f"proxy-{port}.sock"


def relay_name(run_id: str, node_id: str) -> str:
    return f"bridle-relay-{run_id}-{node_id}"


class Relay:
    """One per node (a Ray actor): the node's containers' Unix sockets, one per proxy address, each connection
    relayed to its address byte for byte (the proxy authenticates each call by its rollout token)."""

    def __init__(self, folder: str, connect_timeout_s: float):
        self.folder, self.connect_timeout_s = Path(folder), connect_timeout_s
        self.counts = {"connections": 0, "failed": 0, "bytes_up": 0, "bytes_down": 0}
        self.by_port: dict[int, int] = {}  # connections per proxy port
        self._listeners: dict[tuple[str, int], tuple[anyio.abc.SocketListener, Any]] = {}

    async def serve(self, host: str, port: int) -> str:
        """Listen for the proxy at host:port (once; the socket open to every uid: the harness runs as its own);
        returns the socket's path."""
        import asyncio
        from functools import partial

        path = self.folder / socket_name(port)
        if (host, port) in self._listeners:
            return str(path)
        if any(p == port for _, p in self._listeners):
            raise ValueError(f"relay {self.folder}: port {port} is already relayed to another host")
        self.folder.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        listener = await anyio.create_unix_listener(path, mode=0o666)
        # The actor's event loop keeps the accept loop going between method calls.
        task = asyncio.get_running_loop().create_task(listener.serve(partial(self._relay, host, port)))
        self._listeners[(host, port)] = (listener, task)
        return str(path)

    async def stats(self) -> dict[str, Any]:
        return {**self.counts, "by_port": dict(self.by_port)}

    async def stop(self) -> None:
        for listener, task in self._listeners.values():
            task.cancel()
            await listener.aclose()
        self._listeners.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def _relay(self, host: str, port: int, client: anyio.abc.SocketStream) -> None:
        self.counts["connections"] += 1
        self.by_port[port] = self.by_port.get(port, 0) + 1
        async with client:
            try:
                with anyio.fail_after(self.connect_timeout_s):
                    upstream = await anyio.connect_tcp(host, port)
            except (OSError, TimeoutError):
                self.counts["failed"] += 1  # the harness sees its connection closed, as when the proxy is down
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, "bytes_up")
                tg.start_soon(self._pump, upstream, client, "bytes_down")

    async def _pump(self, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, counter: str) -> None:
        try:
            async for chunk in src:
                self.counts[counter] += len(chunk)
                await dst.send(chunk)
            await dst.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await dst.aclose()


class _NodeDocker(DockerBackend):
    """The Docker backend inside one rollout's Ray task: one of many processes of the run on its node, so it
    reaps only containers whose owner died; it remembers the rollout's folder, to send a kept one back, and labels
    its containers with the Ray node's id (``bridle.ray_node``)."""

    sole_owner = False
    root: Path | None = None
    node_id = ""
    snapshot_spec: SnapshotSpec | None = None
    snapshot: str | None = None
    snapshot_error = ""

    def _labels_for(self, rollout_id: str, role: str) -> dict[str, str]:
        return {**super()._labels_for(rollout_id, role), "bridle.ray_node": self.node_id}

    async def cleanup(self, box: DockerSandbox) -> None:
        self.root = box.root
        await super().cleanup(box)

    async def verify(self, box: DockerSandbox) -> Verdict:
        verdict = await super().verify(box)
        spec = self.snapshot_spec
        if spec is not None:  # the judge on the driver reads the workspace as it is now, before cleanup
            try:
                self.snapshot = await take_snapshot(self.workspace(box), spec.max_chars, spec.max_file_chars,
                                                    spec.timeout_s)
            except JudgeError as e:
                self.snapshot_error = str(e)
        return verdict


def run_on_node(job_bytes: bytes, task_archive: bytes) -> bytes:
    """A rollout's Ray task: the Docker backend's run on this node, its result msgspec-encoded."""
    import ray

    job = msgspec.msgpack.decode(job_bytes, type=NodeJob)
    node_id = ray.get_runtime_context().get_node_id()
    return msgspec.msgpack.encode(run_main(_run_on_node, job, task_archive, node_id))


async def _run_on_node(job: NodeJob, task_archive: bytes, node_id: str) -> NodeResult:
    req = job.request

    def failed(details: str) -> NodeResult:
        fin = RolloutFinished(rollout_id=req.rollout_id, group_id=req.group_id, status="sandbox_error",
                              details=f"node {node_id[:12]}: {details}")
        return NodeResult(finished=fin, node_id=node_id)

    sock = relay_socket(job.relay_dir, job.run_id, node_id, job.proxy_port)
    if not await anyio.Path(sock).exists():
        return failed(f"no proxy relay at {sock} (a node that joined moments ago gets one within "
                      "[sandbox.ray] node_check_s)")
    try:
        task = await anyio.to_thread.run_sync(_unpacked_task, task_archive, job.task_hash, job.task_name,
                                              job.task_cache_idle_s)
    except (OSError, tarfile.TarError, TaskError) as e:
        return failed(f"could not unpack the task: {e}")
    backend = _NodeDocker(job.docker, job.common, run_id=job.run_id)
    backend.node_id = node_id
    backend.snapshot_spec = job.snapshot
    try:
        await backend.start()
    except RuntimeError as e:
        return failed(str(e))
    try:
        fin = await backend.run(req, task, proxy_url="", proxy_socket=str(sock))
    except BaseException:  # a cancelled task: nothing of the sandbox may outlive it
        backend.emergency_stop()
        raise
    finally:
        await backend.aclose()
    out = NodeResult(finished=fin, node_id=node_id, snapshot=backend.snapshot, snapshot_error=backend.snapshot_error)
    if job.common.keep_workspaces and backend.root is not None:
        out.workspace_name = backend.root.name
        try:
            out.workspace = await anyio.to_thread.run_sync(_tar, backend.root)
        except (OSError, RecursionError) as e:  # a policy's folder chain too deep for tarfile
            log.warning("workspace_not_sent", rollout=req.rollout_id, node=node_id, error=type(e).__name__)
        finally:
            await anyio.to_thread.run_sync(remove_tree, backend.root)
    return out


def _unpacked_task(archive: bytes, digest: str, name: str, idle_s: float, cache: Path | None = None) -> Task:
    """The task folder from its archive, unpacked once per node into a folder named by its hash; its use is marked
    (mtime) and folders unused for ``idle_s`` go."""
    cache = cache or Path(tempfile.gettempdir()) / "bridle-ray-tasks"
    root = cache / digest
    if not root.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=cache))
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        try:
            tmp.rename(root)
        except OSError:  # another rollout of the same task unpacked it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    root.touch()  # in use: the folder's mtime is its last use
    prune_task_cache(cache, idle_s, keep=root)
    return load_task(root / name)


def prune_task_cache(cache: Path, idle_s: float, *, keep: Path) -> list[str]:
    """Remove the node's task folders (and half-unpacked ones a killed task left) unused for ``idle_s``; their
    names. Another process may be pruning at the same time: a folder gone meanwhile is skipped."""
    now, gone = time.time(), []
    for d in cache.iterdir():
        try:
            idle = now - d.stat().st_mtime
        except OSError:
            continue
        if d != keep and idle > idle_s:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


def _tar(root: Path, arcname: str = ".") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname=arcname)
    return buf.getvalue()


class RayBackend:
    """Rollouts as Ray tasks on the cluster's Docker nodes (see the module docstring). Runs in the sandbox actor's
    process, which is the Ray driver."""

    kind = "ray"
    judge: Judge | None = None  # the rubric judge, asked here with the snapshot the node sends (module docstring)

    def __init__(self, settings: RaySettings, docker: DockerSettings, common: SandboxCommon | None = None, *,
                 run_id: str):
        self.settings, self.docker, self.run_id = settings, docker, run_id
        self.common = SandboxCommon.of(common) if common is not None else SandboxCommon()
        self._remote: Any = None
        self._owns_ray = False
        self._relays: dict[str, Any] = {}  # node id -> its Relay actor
        self._relayed: dict[str, set[tuple[str, int]]] = {}  # node id -> the proxy addresses its relay serves
        self._listed = -float("inf")
        self._relay_lock = anyio.Lock()
        # task folder -> (archive hash, its object ref), most recently used last; at most archive_cache of them
        self._tasks: OrderedDict[Path, tuple[str, Any]] = OrderedDict()

    async def start(self) -> None:
        ray = _ray()
        s = self.settings

        def connect() -> None:
            if not ray.is_initialized():
                ray.init(address=s.address, namespace=s.namespace, log_to_driver=False,
                         logging_level="warning", configure_logging=False)
                self._owns_ray = True

        try:
            with anyio.fail_after(s.connect_timeout_s):
                await anyio.to_thread.run_sync(connect, abandon_on_cancel=True)
        except (ConnectionError, RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"cannot join the Ray cluster at [sandbox.ray] address = {s.address!r} "
                               f"({type(e).__name__}: {e}); start it with `ray start --head --resources "
                               f"'{{\"{s.resource}\": 8}}'` (configs/ray-cluster.toml)") from None
        self._remote = ray.remote(run_on_node)
        self._relay_actor = ray.remote(Relay)
        nodes = await anyio.to_thread.run_sync(ray.nodes)
        if not any(n["Alive"] and n["Resources"].get(s.resource, 0) > 0 for n in nodes):
            # Not an error: an autoscaler (KubeRay, Slurm) adds such nodes when rollouts ask for them
            log.warning("no_sandbox_node", resource=s.resource, nodes=len(nodes),
                        hint=f"rollouts wait until a node declares it: ray start ... --resources "
                             f"'{{\"{s.resource}\": 8}}' (`ray status` lists the resources)")

    async def aclose(self) -> None:
        ray = _ray()
        with anyio.CancelScope(shield=True):
            for node_id, relay in list(self._relays.items()):
                with anyio.move_on_after(5):
                    try:
                        log.info("relay_stats", node=node_id, **await relay.stats.remote())
                        await relay.stop.remote()
                    except ray.exceptions.RayError as e:  # its node is gone, and the relay with it
                        log.info("relay_lost", node=node_id, error=type(e).__name__)
                ray.kill(relay)
            self._relays.clear()
            self._relayed.clear()
            if self._owns_ray:
                await anyio.to_thread.run_sync(ray.shutdown)
                self._owns_ray = False

    async def relay_stats(self) -> dict[str, dict[str, Any]]:
        """Each relay's counters (and connections per proxy port, ``by_port``), by node id (the nodes still
        alive)."""
        ray = _ray()
        out = {}
        for node_id, relay in self._relays.items():
            try:
                out[node_id] = await relay.stats.remote()
            except ray.exceptions.RayError:
                continue
        return out

    async def run(self, req: RolloutRequest, task: Task, *, proxy_url: str, proxy_socket: str = "") -> RolloutFinished:
        """One rollout on a node Ray picks. ``proxy_url``: the TCP address of the proxy (worker) that owns the
        rollout (what the relays dial); ``proxy_socket`` is this machine's and unused."""
        ray = _ray()
        _, port = await self._ensure_relays(proxy_url)
        digest, archive = await self._task_archive(task)
        spec = None
        if self.judge is not None and judged(req) and self.judge.rubric(task) is not None:
            js = self.judge.settings
            spec = SnapshotSpec(max_chars=js.max_workspace_chars, max_file_chars=js.max_file_chars,
                                timeout_s=js.timeout_s)
        job = NodeJob(request=req, docker=self.docker, common=self.common, run_id=self.run_id, relay_dir=self.settings.relay_dir,
                      proxy_port=port, task_hash=digest, task_name=task.root.name,
                      task_cache_idle_s=self.settings.task_cache_idle_s, snapshot=spec)
        s = self.settings
        ref = self._remote.options(
            resources={s.resource: 1, **s.resources}, num_cpus=s.num_cpus, max_retries=0, retry_exceptions=False,
            name=f"bridle-rollout-{req.rollout_id}", scheduling_strategy=s.scheduling.upper(),
        ).remote(msgspec.msgpack.encode(job), archive)
        limit = harness_limit(req, task) + s.overhead_s
        try:
            with anyio.fail_after(limit):
                raw = await ref
        except ray.exceptions.RayError as e:
            return self._lost(req, f"its Ray task failed ({type(e).__name__}): {str(e)[:2000]}")
        except TimeoutError:
            ray.cancel(ref, force=True)
            return self._lost(req, f"no result within {limit:g}s (its harness limit + [sandbox.ray] overhead_s)")
        except BaseException:
            ray.cancel(ref)  # the task removes its containers on the way out
            raise
        out = msgspec.msgpack.decode(raw, type=NodeResult)
        if out.workspace:
            await anyio.to_thread.run_sync(self._unpack_workspace, out)
        log.info("ray_rollout", rollout=req.rollout_id, node=out.node_id, status=out.finished.status)
        if spec is not None:
            return await self._judged(task, out)
        return out.finished

    async def _judged(self, task: Task, out: NodeResult) -> RolloutFinished:
        """The node's result with the judge's score mixed in, as the other backends mix it (the verifier gave a
        reward: status ok, or timeout with the workspace scored)."""
        fin = out.finished
        if fin.status not in ("ok", "timeout") or (out.snapshot is None and not out.snapshot_error):
            return fin
        assert self.judge is not None
        verdict = Verdict(reward=fin.reward, rewards=fin.rewards, summary=fin.details)
        if out.snapshot is None:
            j = self.judge.failed(task, JudgeError(out.snapshot_error), fin.reward, fin.rewards)
        else:
            j = await self.judge.judge_snapshot(task, out.snapshot, fin.reward, fin.rewards)
        timings = msgspec.structs.replace(fin.timings, verified=time.time())
        try:
            v = judged_verdict(verdict, j, self.judge.settings.on_failure)
        except VerifierError as e:
            return msgspec.structs.replace(fin, status="verifier_error", details=str(e), reward=0.0, rewards={},
                                           timings=timings)
        # a timed-out harness keeps its own details (the harness's output), as with the other backends
        return msgspec.structs.replace(fin, reward=v.reward, rewards=v.rewards, timings=timings,
                                       details=v.summary if fin.status == "ok" else fin.details)

    def _lost(self, req: RolloutRequest, why: str) -> RolloutFinished:
        log.warning("ray_rollout_lost", rollout=req.rollout_id, why=why)
        return RolloutFinished(rollout_id=req.rollout_id, group_id=req.group_id, status="sandbox_error",
                               details=f"the sandbox's node was lost: {why}")

    def _unpack_workspace(self, out: NodeResult) -> None:
        where = Path(self.settings.workspaces or self.common.workdir or tempfile.gettempdir())
        dest = where / out.workspace_name
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(out.workspace)) as tar:
            tar.extractall(dest, filter="data")

    async def _task_archive(self, task: Task) -> tuple[str, Any]:
        """The task folder as a tar archive in Ray's object store (once per task), and its hash."""
        if task.root in self._tasks:
            self._tasks.move_to_end(task.root)
        else:
            data = await anyio.to_thread.run_sync(_tar, task.root, task.root.name)
            self._tasks[task.root] = (hashlib.sha256(data).hexdigest()[:32], _ray().put(data))
            # Dropping a reference frees the archive once no submitted rollout holds it (Ray keeps a task's
            # arguments alive until it ends), so thousands of tasks do not pile up in the object store.
            while len(self._tasks) > self.settings.archive_cache:
                self._tasks.popitem(last=False)
        return self._tasks[task.root]

    async def _ensure_relays(self, proxy_url: str) -> tuple[str, int]:
        """A relay on every alive node with the resource (the node list read again every ``node_check_s``),
        listening for the proxy at ``proxy_url``; that proxy's (host, port) as the relays dial it."""
        target = self._proxy_address(proxy_url)
        if (time.monotonic() - self._listed < self.settings.node_check_s
                and all(target in self._relayed[n] for n in self._relays)):
            return target
        async with self._relay_lock:
            ray = _ray()
            if time.monotonic() - self._listed >= self.settings.node_check_s:
                nodes = await anyio.to_thread.run_sync(ray.nodes)
                for n in nodes:
                    if n["Alive"] and n["Resources"].get(self.settings.resource, 0) > 0 and n["NodeID"] not in self._relays:
                        self._new_relay(n["NodeID"])
                self._listed = time.monotonic()
            for node_id, relay in list(self._relays.items()):
                if target in self._relayed[node_id]:
                    continue
                try:
                    with anyio.fail_after(self.settings.connect_timeout_s):
                        path = await relay.serve.remote(*target)
                except (ray.exceptions.RayError, TimeoutError) as e:
                    log.warning("relay_not_started", node=node_id, proxy=f"{target[0]}:{target[1]}",
                                error=f"{type(e).__name__}: {e}")
                    ray.kill(relay)  # made again at the next node check, if its node is alive
                    del self._relays[node_id], self._relayed[node_id]
                    continue
                self._relayed[node_id].add(target)
                log.info("relay_started", node=node_id, socket=path, proxy=f"{target[0]}:{target[1]}")
        return target

    def _new_relay(self, node_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._relays[node_id] = self._relay_actor.options(
            name=relay_name(self.run_id, node_id), num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(str(relay_folder(self.settings.relay_dir, self.run_id, node_id)), self.settings.connect_timeout_s)
        self._relayed[node_id] = set()

    def _proxy_address(self, proxy_url: str) -> tuple[str, int]:
        if self.settings.proxy_address:
            return split_address(self.settings.proxy_address, "[sandbox.ray] proxy_address")
        url = urlsplit(proxy_url)
        host = url.hostname or ""
        if host in WILDCARD_HOSTS:
            host = _ray().util.get_node_ip_address()
        if url.port is None:
            raise ValueError(f"the proxy's address {proxy_url!r} has no port; set [sandbox.ray] proxy_address")
        return host, url.port
