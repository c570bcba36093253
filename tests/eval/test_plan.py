"""Evaluation plans: columns, held-out tasks by content, one round's bookkeeping, the [eval] checks."""

import shutil

import msgspec
import pytest

from actors import REGISTRY
from pipeline.core import config as cfg
from pipeline.core.runtime import make_resolver
from pipeline.eval.plan import EvalSettings, column_of, harnesses, held_out, plan_round
from pipeline.messages import RolloutFinished, SettledRollout
from pipeline.rollout.harness_space import PUBLISHED_HELD_OUT, PUBLISHED_TRAINING
from pipeline.rollout.taskgen import generate_to
from pipeline.rollout.tasks import load_task_dir


def test_columns_follow_the_space():
    assert column_of("whitebox:" + PUBLISHED_TRAINING[3]) == "in-space"
    assert column_of("whitebox:S0T2O1C1W2") == "held-out"
    assert column_of("whitebox:S0T2O1C1W2", "generated") == "in-space"  # the generated array contains it
    assert column_of("codex") == "out-of-space"
    custom = next(f"S{s}T0O0C0W{w}" for s in range(3) for w in range(3)
                  if f"S{s}T0O0C0W{w}" not in PUBLISHED_TRAINING + PUBLISHED_HELD_OUT)
    assert column_of("whitebox:" + custom) == "custom"


def test_columns_of_the_random18_and_all_spaces():
    from pipeline.rollout.harness_space import design

    drawn = design("random18", seed=2)[0][0].name
    assert column_of("whitebox:" + drawn, "random18", 2) == "in-space"
    assert column_of("whitebox:" + PUBLISHED_HELD_OUT[0], "random18", 2) == "held-out"
    # every configuration is trained on under "all", the published held-out ones too
    assert column_of("whitebox:" + PUBLISHED_HELD_OUT[0], "all") == "in-space"
    s = EvalSettings(columns=["in-space"], configs_per_column=4, space="random18", space_seed=2)
    assert [h for h, _ in harnesses(s)] == ["whitebox:" + c.name for c in design("random18", seed=2)[0][::4][:4]]


def test_spread_takes_n_evenly_from_the_first():
    from pipeline.eval.plan import spread

    assert spread(list(range(18)), 6) == [0, 3, 6, 9, 12, 15]
    assert spread(list(range(18)), 0) == list(range(18)) and spread([1, 2], 5) == [1, 2]
    assert spread(list(range(243)), 6) == [0, 40, 80, 120, 160, 200]
    assert spread(["a"], 6) == ["a"]


def test_harness_list_expands_columns_without_repeats():
    s = EvalSettings(columns=["in-space", "held-out"], configs_per_column=3,
                     harnesses=["claude-code", "whitebox:" + PUBLISHED_TRAINING[0]])
    hs = harnesses(s)
    assert [c for _, c in hs] == ["in-space"] * 3 + ["held-out"] * 3 + ["out-of-space"]
    assert hs[0][0] == "whitebox:" + PUBLISHED_TRAINING[0]  # listed once, in its column
    assert len(harnesses(EvalSettings(columns=["held-out"]))) == 18


def test_held_out_drops_tasks_with_a_training_tasks_content(tmp_path):
    train = generate_to(tmp_path / "train", "create_word", 6, seed=0)
    evals = generate_to(tmp_path / "eval", "create_word", 4, seed=99)
    # a copy of a training task under another name is the same task
    shutil.copytree(train[2].root, tmp_path / "eval" / "zz-copy")
    evals = load_task_dir(tmp_path / "eval")
    kept, dropped = held_out(evals, train)
    assert dropped == ["zz-copy"] and len(kept) == len(evals) - 1


def _settled(req):
    return SettledRollout(request=req, finished=RolloutFinished(rollout_id=req.rollout_id, group_id=req.group_id,
                                                                status="ok", reward=1.0), calls=[])


def test_a_round_issues_within_its_bound_and_ends_when_every_rollout_settled(tmp_path):
    tasks = generate_to(tmp_path / "t", "create_word", 3, seed=5)
    s = EvalSettings(harnesses=["whitebox:S0T0O0C0W0", "codex"], samples=2, max_groups_in_flight=2)
    r = plan_round(4, tasks, s, version=7)
    assert r.expected == 3 * 2 * 2
    first = r.next()
    assert len(first) == 4 and {q.group_id for q in first} == {"eval00004-0000", "eval00004-0001"}
    assert all(q.purpose == "eval" and q.eval.step == 4 and q.policy_version == 7 for q in first)
    assert {q.eval.column for q in first} == {"in-space", "out-of-space"}
    assert first[0].eval.family == "create_word" and first[0].eval.oracle_steps >= 2
    assert r.next() == []  # two groups in flight
    for q in first[:2]:
        assert r.add(_settled(q))
    third = r.next()
    assert len(third) == 2  # one group settled: one more goes out
    assert not r.add(_settled(msgspec.structs.replace(first[0], group_id="g00001")))  # a training rollout
    outstanding = first[2:] + third
    for _ in range(10):
        outstanding += r.next()
        for q in outstanding:
            assert r.add(_settled(q))
        outstanding = []
    assert r.done and len(r.settled) == 12 and r.next() == []


def quickstart(extra):
    return cfg.load_experiment("quickstart", make_resolver(REGISTRY), list(extra))


def test_eval_checks_name_the_fields():
    base: list[str] = []  # the quickstart has an evaluator, [eval]
    with pytest.raises(cfg.ConfigError, match=r"\[eval\].ks = \[8\] .*\[eval\].samples = 4"):
        quickstart([*base, "eval.ks=[1, 8]"])
    with pytest.raises(cfg.ConfigError, match=r"\[eval\].tasks is \[scheduler\].tasks"):
        quickstart([*base, 'eval.tasks={tasks="builtin:create_word", count=40, seed=1000}'])
    # the train preset waits for the last round; a custom graph must say so itself
    assert quickstart(["eval.every_steps=5"]).graph.stop_after == ["learner", "eval"]
    custom = quickstart([]).to_dict()
    with pytest.raises(cfg.ConfigError, match=r"add 'eval' to \[graph\].stop_after"):
        cfg.load_experiment(custom, make_resolver(REGISTRY), ["eval.every_steps=5"])
    with pytest.raises(cfg.ConfigError, match=r"\[eval\].standalone .* set by run.py --eval"):
        quickstart(["eval.standalone=true"])
    with pytest.raises(cfg.ConfigError, match=r"\[eval\]: nothing to evaluate"):
        quickstart(["eval.harnesses=[]"])


def _settle_round(rounds, rnd):
    done = None
    for _ in range(100):
        reqs = rnd.next()
        if not reqs:
            break
        for q in reqs:
            done = rounds.settled(_settled(q)) or done
    return done


def test_rounds_standalone_and_during_training(tmp_path):
    from pipeline.eval.plan import Rounds

    tasks = generate_to(tmp_path / "t", "create_word", 2, seed=5)
    quiet = Rounds(EvalSettings(harnesses=["codex"]), steps=30)  # training without periodic eval
    assert not quiet.updated(0, 1) and quiet.start(tasks) is None and not quiet.complete
    assert not quiet.updated(30, 31) and quiet.complete  # the last step: nothing more to evaluate
    alone = Rounds(EvalSettings(harnesses=["codex"], samples=1, every_steps=3, standalone=True), steps=30)
    rnd = alone.start(tasks)
    assert rnd.step == -1 and alone.start(tasks) is None  # one at a time
    assert _settle_round(alone, rnd) is rnd and alone.complete and alone.start(tasks) is None

    train = Rounds(EvalSettings(harnesses=["codex"], samples=1, every_steps=2), steps=5)
    assert train.start(tasks) is None  # nothing before the first policy update
    due = [s for s in range(6) if train.updated(s, s + 1)]
    assert due == [0, 2, 4, 5]  # after the cold start, every 2nd step, and the last
    evaluated = []
    while (rnd := train.start(tasks)) is not None:
        assert rnd.version == rnd.step + 1
        assert _settle_round(train, rnd) is rnd
        evaluated.append(rnd.step)
    assert evaluated == [0, 2, 4, 5] and train.complete
