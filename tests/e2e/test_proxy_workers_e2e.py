"""The quickstart with two proxy workers (``--set proxy.workers=2``), shortened: rollouts are spread over both
processes, every call of every rollout is recorded exactly once, and a replay of the log gives the same trees and
training batches. Then the same in Docker sandboxes, each container reaching its own worker's Unix socket."""

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.helpers.cli import run_py as run
from tests.rollout.conftest import images  # noqa: F401 (the fixture: the white-box image, or skip / fail)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def test_quickstart_with_two_proxy_workers_records_every_call_once_and_replays(tmp_path):
    run_and_check(tmp_path, "quickstart", [])


@pytest.mark.docker
def test_docker_sandboxes_reach_their_own_proxy_worker(tmp_path, images):  # noqa: F811
    run_and_check(tmp_path, "docker", [f'sandbox.workdir="{tmp_path / "work"}"',
                                       'sandbox.docker.build_network="none"'])


def run_and_check(tmp_path: Path, experiment: str, extra: list[str]) -> None:
    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=8",
            "tree.sft_pack=8", "learner.sft_epochs=1", "run.steps=2", "scheduler.group_size=3",
            "run.groups_per_step=2", "scheduler.tasks.count=20", 'monitor.display="off"', "proxy.workers=2", *extra]
    args = ["--experiment", experiment, "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = run(*args)
    assert r.returncode == 0, r.stderr[-4000:]

    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import CallFailed, CallStarted, ModelCall, RolloutRequest, SettledRollout

    events = list(EventLogReader(run_dir / "events.msgpack"))
    routed = {e.msg.rollout_id: e.msg for e in events
              if isinstance(e.msg, RolloutRequest) and e.src.startswith("proxy")}
    calls = [e.msg for e in events if isinstance(e.msg, ModelCall)]
    failed = [e.msg for e in events if isinstance(e.msg, CallFailed)]
    settled = [e.msg for e in events if isinstance(e.msg, SettledRollout)]
    assert len(routed) == 8 + 2 * 2 * 3 and all(q.proxy is not None for q in routed.values())

    # exactly once: no call id twice, each rollout's calls numbered 0..n-1 without a gap, and what the collector
    # settled for a rollout is what the log holds for it
    assert max(Counter(c.call_id for c in calls).values()) == 1
    started = Counter(e.msg.call_id for e in events if isinstance(e.msg, CallStarted))
    assert max(started.values()) == 1 and set(started) == {c.call_id for c in [*calls, *failed]}
    seqs = defaultdict(list)
    for c in [*calls, *failed]:
        seqs[c.rollout_id].append(c.seq)
    assert all(sorted(s) == list(range(len(s))) for s in seqs.values()), seqs
    assert {s.request.rollout_id for s in settled} == set(routed)
    by_rollout = Counter(c.rollout_id for c in calls)
    assert all(len(s.calls) == by_rollout[s.request.rollout_id] for s in settled)

    # both workers served calls, and each served exactly the calls of the rollouts routed to it
    per_worker = Counter(routed[c.rollout_id].proxy.worker for c in calls)
    logged = [int(re.search(r"proxy worker stopped .*\bcalls=(\d+)", (run_dir / f"proxy-worker-{i}.log").read_text())
                  .group(1)) for i in range(2)]
    assert per_worker[0] > 0 and per_worker[1] > 0 and logged == [per_worker[0], per_worker[1]], (per_worker, logged)

    # the same log gives the same trees and the same training batches
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "trees", "--run-dir", str(tmp_path / "rt"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["trees"]["replayed"] == out["trees"]["recorded"] == out["trees"]["identical"] > 0
    r = run("--replay", str(run_dir / "events.msgpack"), "--stage", "learner", "--run-dir", str(tmp_path / "rl"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3
