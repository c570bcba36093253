"""[experiment].seed makes a run reproducible: two runs with one seed train on the same first batch (the same
tasks, sampled tokens and rewards, so the same hash); another seed gives another batch. Real parts: the quickstart
shortened, its built policy, the embedded engine sampling with each rollout's seed, the white-box harness in local
sandboxes, the verifiers, the tree builder."""

import hashlib
import json

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import TreeGroup, ids
from tests.helpers.cli import run_py_together

SHORT = ["run.steps=1", "run.groups_per_step=2", "scheduler.group_size=4", "scheduler.sft_groups=16",
         "tree.sft_pack=8", "learner.sft_epochs=2", 'monitor.display="off"']


def first_batch_hash(run_dir) -> tuple[str, list[str]]:
    """The step-1 groups, hashed: task, harness, every packed token and every rollout's reward (group ids, which the
    run's order of arrival may shuffle, only sort them)."""
    groups = sorted((e.msg for e in EventLogReader(run_dir / "events.msgpack")
                     if isinstance(e.msg, TreeGroup) and e.msg.purpose == "train"), key=lambda g: g.group_id)
    h = hashlib.sha256()
    for g in groups:
        h.update(json.dumps([g.task_id, g.harness, [r.reward for r in g.rollouts]]).encode())
        h.update(ids(g.packed.tokens).tobytes())
    return h.hexdigest(), [g.task_id for g in groups]


def test_one_seed_one_first_batch(tmp_path):
    """The three runs start together on a policy not built yet: one builds it, the others wait for it (a fresh
    checkout's CI caught them building into one folder at once)."""
    runs = {name: tmp_path / name for name in ("a", "b", "c")}
    seeds = {"a": 7, "b": 7, "c": 8}
    model = f'run.model="{tmp_path / "policy"}"'
    done = run_py_together(*([
        "--experiment", "quickstart", "--no-watch", "--run-dir", str(runs[n]),
        *(x for s in (*SHORT, model, f"experiment.seed={seeds[n]}") for x in ("--set", s))] for n in runs))
    for r in done:
        assert r.returncode == 0, r.stderr[-3000:]
    (a, tasks_a), (b, tasks_b), (c, _) = (first_batch_hash(runs[n]) for n in runs)
    assert len(tasks_a) == 2
    assert a == b and tasks_a == tasks_b
    assert c != a
