"""Scheduler decisions: harness modes, oracle scripts, the staleness bound."""

import json
from collections import Counter

import pytest

from pipeline.rollout.harness_space import (
    PUBLISHED_HELD_OUT,
    PUBLISHED_TRAINING,
    HarnessConfig,
    all_configs,
    design,
)
from pipeline.rollout.scheduling import (
    SCALING_VARIANTS,
    Planner,
    SchedulerSettings,
    may_issue,
    oracle_script,
    rollout_requests,
    training_harnesses,
)
from pipeline.rollout.taskgen import generate_to


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return generate_to(tmp_path_factory.mktemp("tasks"), "create_file", 6, seed=0)


def test_single_mode_cycles_every_task_before_repeating(tasks):
    p = Planner(tasks, "single", "whitebox:S0T0O0C0W0", [], 2, 3, seed=1)
    # 6 tasks, 3 groups a step: every 2-step window is one whole pass (what the quickstart's pool relies on),
    # in a fresh order each pass
    epochs = [[a.task.id for s in (2 * e, 2 * e + 1) for a in p.step(s)] for e in range(4)]
    assert all(sorted(ep) == sorted(t.id for t in tasks) for ep in epochs)
    assert len({tuple(ep) for ep in epochs}) > 1
    assert {a.harness for s in range(8, 10) for a in p.step(s)} == {"whitebox:S0T0O0C0W0"}


def test_mix_mode_pairs_each_task_with_each_harness(tasks):
    hs = ["whitebox:S0T0O0C0W0", "claude-code", "codex"]
    p = Planner(tasks, "mix", hs[0], hs, 2, 6, seed=1)
    groups = p.step(0)
    assert len(groups) == 6
    by_task = Counter(a.task.id for a in groups)
    assert set(by_task.values()) == {3}  # two tasks, each with all three harnesses as separate groups
    for t in by_task:
        assert sorted(a.harness for a in groups if a.task.id == t) == sorted(hs)


def test_scaling_mode_uses_k_nearest_training_configs_over_k_steps(tasks):
    train = set(design()[0])  # the published training set, the default space
    p = Planner(tasks, "scaling", "", [], 2, 3, seed=3)
    s0, s1, s2 = p.step(0), p.step(1), p.step(2)
    assert [a.task.id for a in s0] == [a.task.id for a in s1]  # a block of K=2 steps shares its tasks
    assert {a.task.id for a in s2}.isdisjoint({a.task.id for a in s0}) or len(tasks) < 6
    for a, b in zip(s0, s1, strict=True):
        ca, cb = HarnessConfig.parse(a.harness), HarnessConfig.parse(b.harness)
        assert ca in train and cb in train and ca != cb
        nearest = min(ca.distance(c) for c in train if c != ca)
        assert ca.distance(cb) == nearest  # the second harness is one of the anchor's nearest


# ------------------------------------------------------------------------------- harness-scaling variants
def variant(tasks, name, groups_per_step=3, seed=0):
    s = SchedulerSettings(**SCALING_VARIANTS[name])
    p = Planner(tasks, s.mode, s.harness, s.harnesses, s.k, groups_per_step, seed, s.space, assignment=s.assignment,
                space_seed=s.space_seed)
    return s, p


def per_task_harnesses(s, p, blocks):
    """Each task's configurations over each block of K steps (K = 1 in single mode), in step order."""
    k = s.k if s.mode == "scaling" else 1
    out = []
    for b in range(blocks):
        steps = [p.step(b * k + j) for j in range(k)]
        assert all([a.task.id for a in st] == [a.task.id for a in steps[0]] for st in steps)  # one block, one set
        out += [[HarnessConfig.parse(steps[j][i].harness) for j in range(k)] for i in range(len(steps[0]))]
    return out


# what each variant trains on, by the tables published in the paper (and pinned in harness_space)
PUBLISHED = set(PUBLISHED_TRAINING)
EXPECTED_TRAINING = {
    "single": {"S0T0O0C0W0"},
    "published-k1": PUBLISHED,
    "published-k2": PUBLISHED,
    "published-k2-random": PUBLISHED,
    "repeat-2": PUBLISHED,
    "all-243": {c.name for c in all_configs()},
}


def test_the_variants_are_the_papers_ablations():
    assert set(SCALING_VARIANTS) == {*EXPECTED_TRAINING, "random-18"}
    ks = {n: SchedulerSettings(**v).k if v["mode"] == "scaling" else 1 for n, v in SCALING_VARIANTS.items()}
    assert ks == {"single": 1, "published-k1": 1, "published-k2": 2, "published-k2-random": 2, "repeat-2": 2,
                  "random-18": 2, "all-243": 2}


@pytest.mark.parametrize("name", sorted(SCALING_VARIANTS))
def test_each_variant_trains_on_its_set_with_its_assignment(tasks, name):
    s, p = variant(tasks, name)
    trained = [h.removeprefix("whitebox:") for h in training_harnesses(s)]
    assert len(trained) == len(set(trained))
    if name == "random-18":
        assert len(trained) == 18 and not set(trained) & set(PUBLISHED_HELD_OUT)
        assert set(trained) <= {c.name for c in all_configs()} and set(trained) != PUBLISHED
    else:
        assert set(trained) == EXPECTED_TRAINING[name]
    train = {HarnessConfig.parse(n) for n in trained}
    groups = per_task_harnesses(s, p, blocks=30)
    assert {c for hs in groups for c in hs} <= train
    k = len(groups[0])
    assert all(len(hs) == k for hs in groups)
    if k == 1:
        return
    rule = s.assignment
    for first, second in groups:
        if rule == "repeat":
            assert first == second
        else:
            assert first != second
        if rule == "locality":  # the second is one of the anchor's nearest training configurations
            assert first.distance(second) == min(first.distance(c) for c in train if c != first)
    if rule == "random":  # not only nearest neighbours: over 90 tasks some pair lies farther apart
        assert any(a.distance(b) > min(a.distance(c) for c in train if c != a) for a, b in groups)


def test_every_variant_sees_the_same_tasks_for_one_seed(tasks):
    """The task stream ignores the harness choice: variants with the same K train on the same tasks in the same
    order, and single mode on the same as K = 1 (the paired comparison of benchmarks/harness_scaling.py)."""
    def stream(name, steps=8):
        _, p = variant(tasks, name, seed=4)
        return [[a.task.id for a in p.step(i)] for i in range(steps)]

    k2 = [n for n, v in SCALING_VARIANTS.items() if v.get("k") == 2]
    assert len(k2) == 5 and all(stream(n) == stream("published-k2") for n in k2)
    assert stream("single") == stream("published-k1")
    one, two = stream("published-k1"), stream("published-k2")
    assert two[0] == two[1] and one[0] == two[0] and one[1] == two[2]  # K = 2 repeats each block's tasks


@pytest.mark.parametrize("name", sorted(SCALING_VARIANTS))
def test_each_variants_demonstrations_go_through_its_own_training_set(tmp_path, name):
    """The cold start shows every format the variant trains on, spread evenly over its configurations, each
    demonstration a task of its own; "harness" keeps the one-configuration cold start."""
    from pipeline.rollout.scheduling import Issuer

    many = generate_to(tmp_path / "tasks", "create_file", 60, seed=0)
    s = SchedulerSettings(**SCALING_VARIANTS[name], sft_groups=54, sft_group_size=1, max_groups_in_flight=100)
    _, p = variant(many, name)
    sft = [i.assignment for i in Issuer(p, p, s, steps=1, groups_per_step=3).next(max_staleness=1)
           if i.purpose == "sft"]
    used = Counter(a.harness for a in sft)
    trained = training_harnesses(s)
    assert len(sft) == 54 and len({a.task.id for a in sft}) == 54 and set(used) <= set(trained)
    if len(trained) <= 54:
        assert set(used) == set(trained) and max(used.values()) - min(used.values()) == 0  # 54 = 3 x 18 (or 54 x 1)
    else:  # all-243: 54 distinct configurations
        assert len(used) == 54
    one = SchedulerSettings(**SCALING_VARIANTS[name], sft_groups=5, sft_group_size=1, sft_harnesses="harness")
    _, p = variant(many, name)
    assert {i.assignment.harness for i in Issuer(p, p, one, steps=1, groups_per_step=3).next(max_staleness=1)
            if i.purpose == "sft"} == {"whitebox:S0T0O0C0W0"}


def test_variant_settings_validate_and_bad_combinations_are_refused():
    from actors import REGISTRY
    from pipeline.core import config as cfg
    from pipeline.core.runtime import make_resolver

    resolve = make_resolver(REGISTRY)

    def load(**overrides):
        sets = [f"{k.replace('__', '.')}={json.dumps(v)}" for k, v in overrides.items()]
        return cfg.load_experiment("scaling", resolve, sets)

    for name, v in SCALING_VARIANTS.items():
        space = {"eval__space": v["space"]} if "space" in v else {}
        exp = load(**{f"scheduler__{k}": x for k, x in v.items()}, **space)
        assert training_harnesses(exp.sections["scheduler"]) == training_harnesses(SchedulerSettings(**v)), name
    refused = [
        ({"scheduler__k": 19}, r'\[scheduler\].k = 19: assignment = "locality" .* space = "published" has 18'),
        ({"scheduler__mode": "single", "scheduler__assignment": "repeat"},
         r'\[scheduler\]: assignment = \'repeat\': only mode = "scaling" reads it'),
        ({"scheduler__mode": "mix", "scheduler__harnesses": ["codex"], "scheduler__space": "all"},
         r"space = 'all': only mode"),
        ({"scheduler__space": "random18"},
         r"\[eval\].space = 'published', space_seed = 0 but \[scheduler\] trains on space = 'random18'"),
        ({"scheduler__space": "random18", "eval__space": "random18", "scheduler__space_seed": 3},
         r"space_seed = 0 but \[scheduler\] trains on space = 'random18', space_seed = 3"),
        ({"scheduler__space": "nope"}, r"nope"),
    ]
    for overrides, match in refused:
        with pytest.raises(cfg.ConfigError, match=match):
            load(**overrides)
    load(scheduler__k=19, scheduler__space="all", scheduler__assignment="random", eval__space="all")  # 19 of 243
    # repeat may give a task more passes than the set has configurations: one configuration K times
    load(scheduler__k=19, scheduler__assignment="repeat")


def test_oracle_script_follows_the_tool_interface(tasks):
    t = tasks[0]
    s0 = oracle_script(t, "whitebox:S0T0O0C0W0")
    s2 = oracle_script(t, "whitebox:S0T2O0C0W0")
    assert s0[0]["tool_calls"][0]["name"] == "write_file"
    assert s2[0]["tool_calls"][0]["name"] != "write_file"  # opaque id under T2
    assert s0[0]["tool_calls"][0]["arguments"] == s2[0]["tool_calls"][0]["arguments"]
    assert s0[-1] == {"text": "Done."}
    with pytest.raises(ValueError, match="cannot play oracle demonstrations"):
        oracle_script(t, "oracle")


def test_staleness_bound():
    # B = 4 groups per step, max_staleness 1: groups of step k may go out once k - 1 steps are done
    assert [may_issue(j, 0, 4, 1) for j in (0, 3, 4, 7, 8)] == [True, True, True, True, False]
    assert may_issue(8, 1, 4, 1) and not may_issue(12, 1, 4, 1)
    # synchronous: only the current step's groups
    assert [may_issue(j, 0, 4, 0) for j in (0, 3, 4)] == [True, True, False]


# ------------------------------------------------------------------------------------------------ the Issuer
def issuer(tasks, **kw):
    from pipeline.rollout.scheduling import Issuer, SchedulerSettings

    steps = kw.pop("steps", 3)
    gps = kw.pop("groups_per_step", 2)
    s = SchedulerSettings(**{"group_size": 2, "max_groups_in_flight": 10, **kw})
    planner = Planner(tasks, "single", s.harness, [], 2, gps, seed=0)
    return Issuer(planner, planner, s, steps=steps, groups_per_step=gps)


def ids_of(issues):
    return [i.group_id for i in issues]


def test_issuer_bounds_by_staleness_and_frees_slots(tasks):
    iss = issuer(tasks, steps=3, groups_per_step=2)
    # staleness 1: steps 0 and 1 may run ahead of a learner that has done nothing (groups 0..3)
    assert ids_of(iss.next(max_staleness=1)) == ["g00000", "g00001", "g00002", "g00003"]
    assert iss.next(max_staleness=1) == []
    iss.updated(version=1, step=1)
    assert ids_of(iss.next(max_staleness=1)) == ["g00004", "g00005"]
    assert iss.done
    assert iss.in_flight == {f"g{j:05d}": 2 for j in range(6)}
    iss.finished("g00000")
    iss.finished("g00000")
    assert "g00000" not in iss.in_flight


def test_issuer_in_flight_bound(tasks):
    iss = issuer(tasks, max_groups_in_flight=1, steps=2)
    assert ids_of(iss.next(max_staleness=5)) == ["g00000"]
    assert iss.next(max_staleness=5) == []
    iss.finished("g00000")
    iss.finished("g00000")
    assert ids_of(iss.next(max_staleness=5)) == ["g00001"]


def test_demonstrations_first_then_training_waits_for_the_first_update(tasks):
    iss = issuer(tasks, sft_groups=3, sft_group_size=1, steps=1)
    out = iss.next(max_staleness=1)
    assert ids_of(out) == ["sft0000", "sft0001", "sft0002"]
    assert {i.purpose for i in out} == {"sft"} and {i.demonstrations for i in out} == {3}
    assert iss.next(max_staleness=1) == []  # the SFT weights must reach the engine first
    iss.updated(version=4, step=0)
    out = iss.next(max_staleness=1)
    assert ids_of(out) == ["g00000", "g00001"] and {i.purpose for i in out} == {"train"}


def test_resume_continues_the_task_order_with_new_group_ids(tasks):
    full = [i.assignment.task.id for i in issuer(tasks, steps=3).next(max_staleness=5)]
    resumed = issuer(tasks, steps=3)
    resumed.resume(steps_done=1, attempt=2)
    assert resumed.next(max_staleness=5) == []  # waits for the resumed weights
    resumed.updated(version=1, step=1)
    out = resumed.next(max_staleness=5)
    assert ids_of(out) == ["g00002-a2", "g00003-a2", "g00004-a2", "g00005-a2"]
    assert [i.assignment.task.id for i in out] == full[2:]


def test_requests_carry_sampling_purpose_and_fresh_tokens(tasks):
    from pipeline.rollout.scheduling import rollout_requests

    iss = issuer(tasks, temperature=0.7, max_new_tokens=33, sft_groups=1, sft_group_size=2)
    demo = iss.next(max_staleness=1)[0]
    reqs = rollout_requests(demo, iss.settings, version=0)
    assert [r.rollout_id for r in reqs] == ["sft0000-r0", "sft0000-r1"]
    assert len({r.token for r in reqs}) == 2 and all(token_bits(r.token) == 192 for r in reqs)
    assert all(r.script and r.purpose == "sft" and r.demonstrations == 2 for r in reqs)
    assert reqs[0].sampling.temperature == 0.7 and reqs[0].sampling.max_new_tokens == iss.settings.sft_max_new_tokens


def mix_issuer(tasks, **kw):
    from pipeline.rollout.scheduling import Issuer, SchedulerSettings

    hs = ["whitebox:S0T0O0C0W0", "claude-code", "codex"]
    s = SchedulerSettings(**{"mode": "mix", "harnesses": hs, "group_size": 2, "max_groups_in_flight": 20, **kw})
    planner = Planner(tasks, "mix", s.harness, hs, 2, 3, seed=0)
    return Issuer(planner, planner, s, steps=2, groups_per_step=3), hs


def test_mix_demonstrations_pair_each_task_with_every_harness(tasks):
    iss, hs = mix_issuer(tasks, sft_groups=7, sft_group_size=1)
    sft = [i for i in iss.next(max_staleness=1) if i.purpose == "sft"]
    pairs = [(i.assignment.task.id, i.assignment.harness) for i in sft]
    assert len(pairs) == 7 and len(set(pairs)) == 7  # one group per (task, harness) pair
    assert [h for _, h in pairs] == hs + hs + hs[:1]  # every harness in turn
    assert len({t for t, _ in pairs[:3]}) == 1 and pairs[0][0] != pairs[3][0]


def test_mix_resume_skips_the_demonstration_tasks(tasks):
    first, _ = mix_issuer(tasks, sft_groups=6, sft_group_size=1)
    first.next(max_staleness=1)
    first.updated(version=1, step=0)
    full = [i.assignment.task.id for i in first.next(max_staleness=5)]
    resumed, _ = mix_issuer(tasks, sft_groups=6, sft_group_size=1)
    resumed.resume(steps_done=0, attempt=1)
    resumed.updated(version=1, step=0)
    assert [i.assignment.task.id for i in resumed.next(max_staleness=5)] == full


def test_demonstrations_get_their_own_token_cap(tasks):
    from pipeline.rollout.scheduling import rollout_requests

    iss, _ = mix_issuer(tasks, sft_groups=3, sft_group_size=1, max_new_tokens=32, sft_max_new_tokens=900)
    sft = iss.next(max_staleness=1)[0]
    reqs = rollout_requests(sft, iss.settings, version=0)
    assert sft.purpose == "sft" and {r.sampling.max_new_tokens for r in reqs} == {900}
    assert reqs[0].script[-1] == {"text": "Done."} and reqs[0].harness == "whitebox:S0T0O0C0W0"
    iss.updated(version=1, step=0)
    train = next(i for i in iss.next(max_staleness=1) if i.purpose == "train")
    assert {r.sampling.max_new_tokens for r in rollout_requests(train, iss.settings, version=1)} == {32}


def test_dynamic_sampling_replacements_go_out_first_with_their_slot_and_harness(tasks):
    """A replacement asked for (GroupResample) is issued before any new group, even past the staleness bound (its
    slot was issued already), as another task than the group it replaces, drawn the same way after a resume."""
    iss = issuer(tasks, steps=2, groups_per_step=2)
    assert ids_of(iss.next(max_staleness=0)) == ["g00000", "g00001"]
    assert iss.resample("g00001", 1) and iss.resample("g00001-x1", 2)
    assert not iss.done
    out = iss.next(max_staleness=0)  # step 1 may not go out yet; the replacements may
    assert ids_of(out) == ["g00001-x1", "g00001-x2"] and [i.resample for i in out] == [1, 2]
    again = issuer(tasks, steps=2, groups_per_step=2)
    original = again.next(max_staleness=0)[1]
    assert all(i.assignment.task.id != original.assignment.task.id for i in out)
    assert {i.assignment.harness for i in out} == {original.assignment.harness}
    assert again.resample("g00001", 1)
    assert again.next(max_staleness=0)[0].assignment.task.id == out[0].assignment.task.id  # seeded by slot
    assert not iss.resample("g00099", 1)  # not issued by this run
    assert iss.metrics()["groups_resampled"] == 2
    reqs = rollout_requests(out[0], iss.settings, version=0)
    assert {r.resample for r in reqs} == {1} and {r.group_id for r in reqs} == {"g00001-x1"}


def token_bits(token: str) -> int:
    """The random bits of a rollout token: the URL-safe base64 after bridle's prefix, decoded."""
    import base64

    from pipeline.messages import TOKEN_PREFIX

    assert token.startswith(TOKEN_PREFIX), token
    body = token.removeprefix(TOKEN_PREFIX)
    return 8 * len(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


def test_a_rollout_token_carries_192_random_bits():
    import base64

    from pipeline.messages import rollout_token

    tokens = {rollout_token() for _ in range(2000)}
    assert len(tokens) == 2000 and {token_bits(t) for t in tokens} == {192}
    # every bit varies across tokens: none is fixed by the encoding
    raw = [int.from_bytes(base64.urlsafe_b64decode(t.removeprefix("bridle-")), "big") for t in tokens]
    ones = [sum((r >> i) & 1 for r in raw) for i in range(192)]
    assert all(700 < n < 1300 for n in ones), min(ones)

