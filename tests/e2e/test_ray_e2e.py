"""The Docker quickstart across a real two-node Ray cluster on this machine (head and worker: separate raylets),
shortened, through the ray sandbox backend with two proxy workers: rollouts run on both nodes, each node's sandboxes
reaching their rollout's proxy worker through that node's relay (a socket per worker); then the worker node is killed (its whole process group: raylet, workers, relay) while a
sandbox of it runs. Its rollouts end as sandbox_error and the run completes on the head node.

Needs Docker and Ray: skipped on a laptop without them, required in CI.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.eventlog import EventLogReader
from pipeline.core.runfiles import run_tag
from pipeline.messages import RolloutFinished, RolloutRequest
from pipeline.rollout.sandbox.ray_backend import relay_folder
from tests.helpers.ci import require
from tests.helpers.docker import containers_of
from tests.rollout.conftest import images  # noqa: F401 (the fixture: the white-box image, or skip / fail)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.docker]


@pytest.fixture(scope="module")
def cluster(images):  # noqa: F811
    require(importlib.util.find_spec("ray") is not None, "Ray is not installed (pip install -e '.[ray]')")
    from tests.helpers.raycluster import start_cluster

    c = start_cluster(slots=2)
    try:
        yield c
    finally:
        c.stop()


def events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return out


def test_quickstart_on_two_ray_nodes_survives_losing_the_worker(cluster, tmp_path):
    nodes = cluster.node_ids()
    run_dir = tmp_path / "run"
    sets = [
        f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60",
        "scheduler.sft_groups=4", "tree.sft_pack=4", "learner.sft_epochs=1",
        "run.steps=3", "scheduler.group_size=3", "run.groups_per_step=2", "scheduler.tasks.count=40",
        'monitor.display="off"', 'sandbox.backend="ray"', "proxy.workers=2", f'sandbox.ray.address="{cluster.address}"',
        f'sandbox.workdir="{tmp_path / "work"}"', 'sandbox.docker.build_network="none"',
    ]
    args = [sys.executable, "run.py", "--experiment", "docker", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    console = tmp_path / "console.txt"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=console.open("wb"), stderr=subprocess.STDOUT)
    killed_at = None
    try:
        # Once rollouts have finished on both nodes and a sandbox of the worker is running: kill the worker.
        deadline = time.monotonic() + 900
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            done = {e.get("node") for e in events(run_dir / "log.jsonl") if e.get("event") == "ray_rollout"}
            if {nodes["head"], nodes["worker"]} <= done and _worker_sandbox_running(nodes["worker"], run_tag(run_dir)):
                cluster.worker.kill()
                killed_at = time.monotonic()
            time.sleep(0.2)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = console.read_text(errors="replace")[-4000:]
    assert killed_at is not None, f"the worker was never seen running a sandbox: {err}"
    assert proc.returncode == 0, err

    log = events(run_dir / "log.jsonl")
    ran = [e for e in log if e.get("event") == "ray_rollout"]
    assert {e["node"] for e in ran} == {nodes["head"], nodes["worker"]}
    assert any(e["node"] == nodes["worker"] and e["status"] == "ok" for e in ran)  # it reached the proxy
    # each node's relay serves both proxy workers (a socket per worker's port)
    relays = {(e["node"], e["proxy"]) for e in log if e.get("event") == "relay_started"}
    assert {n for n, _ in relays} == {nodes["head"], nodes["worker"]}
    assert all(len({p for m, p in relays if m == n}) == 2 for n in nodes.values()), relays
    lost = {e["rollout"] for e in log if e.get("event") == "ray_rollout_lost"}
    assert lost, "no rollout was lost with the worker"
    msgs = [e.msg for e in EventLogReader(run_dir / "events.msgpack")]
    finished = {m.rollout_id: m for m in msgs if isinstance(m, RolloutFinished)}
    # rollouts were routed to both workers, and each worker's rollouts got through to it from a node
    worker_of = {m.rollout_id: m.proxy.worker for m in msgs if isinstance(m, RolloutRequest) and m.proxy}
    ok = [e["rollout"] for e in ran if e["status"] == "ok"]
    assert {worker_of[r] for r in ok} == {0, 1}
    assert all(finished[r].status == "sandbox_error" for r in lost)
    assert all("node was lost" in finished[r].details for r in lost)
    # After the loss, every rollout ran on the head node.
    later = [e for e in ran if e.get("timestamp", "") > max(x["timestamp"] for x in log
                                                             if x.get("event") == "ray_rollout_lost")]
    assert all(e["node"] == nodes["head"] for e in later)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "rl_step"] == [1, 2, 3]
    # The killed node's containers and relay folder outlive it (the Docker engine is not Ray's); what a later run
    # on that node reaps. Removed here, for this machine.
    for cid in containers_of(run_tag(run_dir)):
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=False)
    shutil.rmtree(relay_folder("", run_tag(run_dir), nodes["worker"]), ignore_errors=True)


def _worker_sandbox_running(node_id: str, run: str) -> bool:
    """Whether a harness container of the run is running on the worker node (the label the node gives it)."""
    out = subprocess.run(["docker", "ps", "-q", "--filter", f"label=bridle.run={run}", "--filter",
                          "label=bridle.role=harness", "--filter", f"label=bridle.ray_node={node_id}"],
                         capture_output=True, text=True, check=False).stdout
    return bool(out.split())
