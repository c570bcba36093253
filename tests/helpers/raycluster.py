"""A real two-node Ray cluster on this machine: a head and a worker node, each its own `ray start --block` (its own
raylet, temp dir and process group), so that a test can kill one node and leave the other running."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.ci import require

_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port, never one this process handed out before: a node's ports are picked before any is bound, so
    the kernel may offer the same free port twice (ray start then refuses: "used by other components")."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    temp_dir: Path
    log: Path
    pgid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pgid = self.proc.pid  # started in a session of its own: its raylet and workers share this group

    def kill(self) -> None:
        """SIGKILL the node's whole process group (raylet, workers, agents): a lost machine."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def pids(self) -> set[int]:
        """Every live process of the node's group."""
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.pgid:
                    out.add(int(d.name))
        return out


@dataclass
class Cluster:
    address: str
    head: Node
    worker: Node
    resource: str = "bridle_docker"

    def node_ids(self) -> dict[str, str]:
        """Node name ("head", "worker") -> Ray node id (by the resource naming each; the caller joined with
        ray.init)."""
        import ray

        return {name: n["NodeID"] for n in ray.nodes() if n["Alive"]
                for name in ("head", "worker") if f"node_{name}" in n["Resources"]}

    def stop(self) -> None:
        import ray

        ray.shutdown()
        for node in (self.worker, self.head):
            if node.proc.poll() is None:
                try:
                    os.killpg(node.pgid, signal.SIGTERM)  # ray start --block stops its node's processes
                    node.proc.wait(timeout=5)  # often it does not within 30 s: then the group is killed below
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pgid, signal.SIGKILL)  # whatever of the group is left
        for node in (self.worker, self.head):
            shutil.rmtree(node.temp_dir, ignore_errors=True)


def _start(name: str, args: list[str], env: dict[str, str]) -> Node:
    temp_dir = Path(tempfile.mkdtemp(prefix=f"rt{name[0]}", dir="/tmp"))  # short: Unix socket paths < 108 bytes
    log = temp_dir / "ray-start.log"
    ray = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    require(ray is not None, "the ray CLI is not installed (pip install -e '.[ray]')")
    cmd = [ray, "start", "--block", "--temp-dir", str(temp_dir), "--num-cpus", "1", "--object-store-memory",
           "200000000", "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
           "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
           "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return Node(name=name, proc=proc, temp_dir=temp_dir, log=log)


def start_cluster(slots: int = 4) -> Cluster:
    """Head and worker, each with ``slots`` units of bridle_docker and a resource naming it (node_head,
    node_worker). Returns once both nodes are registered."""
    import ray  # noqa: F401 (skip early when absent)

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    head = _start("head", ["--head", "--port", str(port), "--include-dashboard", "false",
                           "--resources", json.dumps({"bridle_docker": slots, "node_head": 1})], env)
    address = f"{_node_ip()}:{port}"
    worker = None
    try:
        _wait_nodes(address, 1, head)
        worker = start_worker(address, slots)
        _wait_nodes(address, 2, worker)
    except BaseException:
        Cluster(address, head, worker or head).stop()
        raise
    return Cluster(address=address, head=head, worker=worker)


def start_worker(address: str, slots: int) -> Node:
    """A worker node joining the cluster at ``address`` with ``slots`` units of bridle_docker and the resource
    node_worker (also a fresh one in place of a worker that was killed)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return _start("worker", ["--address", address, "--resources",
                             json.dumps({"bridle_docker": slots, "node_worker": 1})], env)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _wait_nodes(address: str, n: int, node: Node, timeout_s: float = 90) -> None:
    """Until ``n`` nodes are alive; joins the cluster from this process (ray.init) on the way."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"ray start ({node.name}) exited: {node.log.read_text(errors='replace')[-3000:]}")
        host, port = address.rsplit(":", 1)
        try:
            if not ray.is_initialized():
                socket.create_connection((host, int(port)), timeout=1).close()  # ray.init would wait long
                ray.init(address=address, namespace="bridle", log_to_driver=False, logging_level="warning")
            if sum(x["Alive"] for x in ray.nodes()) >= n:
                return
        except OSError:  # ConnectionError included
            pass
        time.sleep(1)
    raise TimeoutError(f"{n} Ray node(s) not up within {timeout_s}s: {node.log.read_text(errors='replace')[-3000:]}")
