"""The quickstart with two embedded engines behind sglang-router (``--set proxy.engine.replicas=2``), shortened:
the policy's calls spread over both engines, and every weight push reaches both."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.serving.router import INSTALL, router_available
from tests.helpers.ci import require

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_quickstart_with_two_engines_behind_the_router(tmp_path):
    require(router_available(), f"sglang-router is not installed ({INSTALL})")
    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=8",
            "tree.sft_pack=8", "learner.sft_epochs=1", "run.steps=2", "scheduler.group_size=3",
            "run.groups_per_step=2", "scheduler.tasks.count=20", 'monitor.display="off"', "proxy.engine.replicas=2",
            # round robin: the calls must reach both engines (cache_aware, the default, keeps one prompt on one)
            'proxy.engine.router.policy="round_robin"']
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-4000:]

    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import ModelCall, PolicyUpdated, RolloutRequest

    events = [e.msg for e in EventLogReader(run_dir / "events.msgpack")]
    purpose = {m.rollout_id: m.purpose for m in events if isinstance(m, RolloutRequest)}
    policy_calls = [m for m in events if isinstance(m, ModelCall) and purpose[m.rollout_id] == "train"]
    pushed = [m.version for m in events if isinstance(m, PolicyUpdated) and m.weights_path]
    logs = [(run_dir / f"engine-embedded-{i}.log").read_text() for i in range(2)]
    served = [int(re.search(r"embedded engine stopped .*\brequests=(\d+)", log).group(1)) for log in logs]
    updated = [re.findall(r"weights updated .*\bversion=(\d+)", log) for log in logs]
    # the router sent the policy's calls to both engines (demonstrations are scripted: no engine call)
    assert all(n > 0 for n in served) and sum(served) == len(policy_calls), (served, len(policy_calls))
    # every push the proxy applied reached both engines, in order (a run may end before it applies the last one)
    assert updated[0] == updated[1] and updated[0] == [str(v) for v in pushed[: len(updated[0])]]
    assert len(updated[0]) >= 2, updated
    assert {s.version for c in policy_calls for s in c.versions} <= {0, *pushed}
    assert (run_dir / "engine-embedded-router.log").exists()


def test_distributed_weight_sync_reaches_both_engines_behind_the_router(tmp_path):
    """``weight_sync = "distributed"``: the learner is rank 0, the two engines ranks 1 and 2 of one gloo group; every
    RL update is one broadcast both receive, and both hold each pushed version."""
    require(router_available(), f"sglang-router is not installed ({INSTALL})")
    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=8",
            "tree.sft_pack=8", "learner.sft_epochs=1", "run.steps=2", "scheduler.group_size=3",
            "run.groups_per_step=1", "scheduler.tasks.count=20", 'monitor.display="off"', "proxy.engine.replicas=2",
            'learner.weight_sync="distributed"']
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-4000:]

    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import PolicyUpdated

    updates = [e.msg for e in EventLogReader(run_dir / "events.msgpack") if isinstance(e.msg, PolicyUpdated)]
    pushed = [str(u.version) for u in updates if u.pushed]
    assert len(pushed) == 2 and not any(u.weights_path for u in updates if u.pushed)
    logs = [(run_dir / f"engine-embedded-{i}.log").read_text() for i in range(2)]
    assert all(re.search(r"weight update group joined .*\brank=" + str(i + 1), log) for i, log in enumerate(logs))
    for log in logs:
        assert re.findall(r"weights updated over the process group .*\bversion=(\d+)", log) == pushed
