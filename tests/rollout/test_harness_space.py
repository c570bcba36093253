"""The harness space: configurations, the orthogonal training design, held-out set, locality assignment."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness_images.whitebox.agent import components
from pipeline.rollout import harness_space
from pipeline.rollout.harness_space import (
    CANONICAL_TOOLS,
    COMPONENTS,
    PUBLISHED_HELD_OUT,
    PUBLISHED_TRAINING,
    HarnessConfig,
    all_configs,
    assign,
    design,
    held_out_configs,
    locality_assignment,
    offered_tools,
    orthogonal_array,
    tool_name_for,
    training_configs,
)

# Harness Scaling, Table 6 (training set) and Table 8 (held-out set), as published.
PAPER_TABLE_6 = list(PUBLISHED_TRAINING)
PAPER_TABLE_8 = list(PUBLISHED_HELD_OUT)


def pair_counts(array: np.ndarray, levels: int) -> set[int]:
    """The distinct counts of level pairs over every two columns; strength 2 means exactly one value."""
    counts = set()
    for i, j in itertools.combinations(range(array.shape[1]), 2):
        table = np.zeros((levels, levels), dtype=int)
        np.add.at(table, (array[:, i], array[:, j]), 1)
        counts |= set(table.ravel().tolist())
    return counts


def as_array(configs) -> np.ndarray:
    return np.array([c.levels for c in configs])


# ------------------------------------------------------------------------------------------------ configs
def test_space_has_243_named_configs():
    configs = all_configs()
    assert len(configs) == len(set(configs)) == 243
    assert configs[0].name == "S0T0O0C0W0" and configs[-1].name == "S2T2O2C2W2"
    assert all(HarnessConfig.parse(c.name) == c for c in configs)
    assert HarnessConfig.parse("whitebox:S0T1O2C1W0").adapter == "whitebox:S0T1O2C1W0"
    assert HarnessConfig.parse("S0T1O2C1W0").realizations() == {
        "S": "direct",
        "T": "semantic_aliases",
        "O": "execution_metadata",
        "C": "in_context_summary",
        "W": "free_form",
    }


@pytest.mark.parametrize("bad", ["S0T1O2C1", "S3T0O0C0W0", "T0S0O0C0W0", "s0t0o0c0w0", ""])
def test_parse_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="S0T1O2C1W0"):
        HarnessConfig.parse(bad)


def test_config_rejects_out_of_range_level():
    with pytest.raises(ValueError, match="HarnessConfig.o=3"):
        HarnessConfig(0, 0, 3, 0, 0)


def test_distance_is_hamming():
    a = HarnessConfig.parse("S0T1O2C1W0")
    assert a.distance(a) == 0
    assert a.distance(HarnessConfig.parse("S0T1O2C1W2")) == 1
    assert a.distance(HarnessConfig.parse("S1T2O0C2W1")) == 5


# ------------------------------------------------------------------------------------- orthogonal arrays
def test_rao_hamming_two_levels_by_hand():
    # rows (x, y), columns x, y, y + x (mod 2)
    assert orthogonal_array(2, 3).tolist() == [[0, 0, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]]


def test_five_factors_at_three_levels_need_18_runs_and_are_balanced():
    oa = orthogonal_array(3, 5)
    assert oa.shape == (18, 5)
    assert pair_counts(oa, 3) == {2}  # every pair of levels of every two components, twice
    assert orthogonal_array(3, 4).shape == (9, 4)  # up to L + 1 factors fit in L^2 runs


@pytest.mark.parametrize(
    "levels,factors,runs",
    [(2, 1, 4), (2, 3, 4), (3, 4, 9), (3, 7, 18), (5, 6, 25), (5, 11, 50), (7, 8, 49), (7, 15, 98)],
)
def test_arrays_are_strength_two(levels, factors, runs):
    oa = orthogonal_array(levels, factors)
    assert oa.shape == (runs, factors)
    assert oa.min() >= 0 and oa.max() < levels
    assert pair_counts(oa, levels) == ({runs // levels**2} if factors > 1 else set())


@given(st.sampled_from([2, 3, 5, 7, 11]), st.data())
@settings(max_examples=30, deadline=None)
def test_any_supported_shape_is_strength_two(levels, data):
    most = levels + 1 if levels == 2 else 2 * levels + 1
    factors = data.draw(st.integers(2, most))
    oa = orthogonal_array(levels, factors)
    assert len(pair_counts(oa, levels)) == 1
    assert len({tuple(r) for r in oa.tolist()}) == len(oa)  # no repeated runs


@pytest.mark.parametrize(
    "levels,factors,msg",
    [(4, 3, "prime"), (6, 2, "prime"), (2, 4, "at most 3"), (3, 8, "at most 4"), (3, 0, "at least one")],
)
def test_unsupported_shapes_are_refused(levels, factors, msg):
    with pytest.raises(ValueError, match=msg):
        orthogonal_array(levels, factors)


# ------------------------------------------------------------------------------------------ training set
def test_training_set_is_an_18_run_strength_two_design():
    train = training_configs()
    assert len(train) == len(set(train)) == 18
    arr = as_array(train)
    assert pair_counts(arr, 3) == {2}
    for col in range(5):
        assert Counter(arr[:, col].tolist()) == {0: 6, 1: 6, 2: 6}


def test_training_set_versus_paper_table_6():
    """Table 6 is our design translated by a constant shift: the same orthogonal array up to relabeling
    each component's realizations cyclically (see the README's harness-space section)."""
    ours = {c.levels for c in training_configs()}
    paper = [HarnessConfig.parse(n) for n in PAPER_TABLE_6]
    assert pair_counts(as_array(paper), 3) == {2}  # the published table is strength 2 too
    shifts = [
        s
        for s in itertools.product(range(3), repeat=5)
        if {tuple((a + b) % 3 for a, b in zip(lv, s, strict=True)) for lv in ours} == {c.levels for c in paper}
    ]
    # the design is invariant under T, O, C, W all +1 (y -> y + 1 in the construction), hence three shifts
    assert shifts == sorted((2, k, (2 + k) % 3, (1 + k) % 3, (2 + k) % 3) for k in range(3))
    shared = sorted(c.name for c in paper if c.levels in ours)
    print("\nTable 6 = ours + (S+2, T+0, O+2, C+1, W+2) mod 3")
    print(f"{'ours':<12}{'ours shifted':<14}{'in Table 6'}")
    for c in training_configs():
        moved = HarnessConfig.from_levels([(a + b) % 3 for a, b in zip(c.levels, (2, 0, 2, 1, 2), strict=True)])
        print(f"{c.name:<12}{moved.name:<14}{moved.name in PAPER_TABLE_6}")
    print(f"configurations in both sets as they stand: {len(shared)} ({', '.join(shared)})")
    dist = Counter(a.distance(b) for a, b in itertools.combinations(paper, 2))
    ours_dist = Counter(a.distance(b) for a, b in itertools.combinations(training_configs(), 2))
    assert dist == ours_dist == {2: 12, 3: 54, 4: 81, 5: 6}


# ----------------------------------------------------------------------------------------------- held out
def test_held_out_is_disjoint_and_balanced():
    train = training_configs()
    held = held_out_configs(train, seed=0)
    assert len(held) == len(set(held)) == 18
    assert not set(held) & set(train)
    arr = as_array(held)
    for col in range(5):
        assert Counter(arr[:, col].tolist()) == {0: 6, 1: 6, 2: 6}
    assert pair_counts(arr, 3) == {2}
    assert held_out_configs(train, seed=0) == held
    assert len({tuple(held_out_configs(train, seed=s)) for s in range(5)}) > 1


def test_paper_table_8_is_balanced_but_not_orthogonal():
    """Documents the difference to the paper's held-out set: balanced marginals, no pair balance."""
    paper = as_array([HarnessConfig.parse(n) for n in PAPER_TABLE_8])
    assert all(Counter(paper[:, col].tolist()) == {0: 6, 1: 6, 2: 6} for col in range(5))
    assert len(pair_counts(paper, 3)) > 1
    assert not set(PAPER_TABLE_8) & set(PAPER_TABLE_6)


def test_published_space_is_the_default_and_keeps_the_papers_held_out_set_out_of_training():
    train, held = design()
    assert [c.name for c in train] == PAPER_TABLE_6 and [c.name for c in held] == PAPER_TABLE_8
    assert "S0T2O1C1W2" in PAPER_TABLE_8 and "S0T2O1C1W2" not in PAPER_TABLE_6
    assert HarnessConfig.parse("S0T2O1C1W2") in training_configs()  # why the generated array is not the default
    gen_train, gen_held = design("generated")
    assert gen_train == training_configs() and not set(gen_train) & set(gen_held)
    with pytest.raises(ValueError, match="'nope'"):
        design("nope")


def test_random18_is_a_seeded_draw_of_18_outside_the_published_held_out_set():
    train, held = design("random18", seed=0)
    names = [c.name for c in train]
    assert len(names) == len(set(names)) == 18
    assert set(train) <= set(all_configs())
    assert not set(names) & set(PAPER_TABLE_8)  # so its held-out column is still never trained on
    assert [c.name for c in held] == PAPER_TABLE_8
    assert design("random18", seed=0) == (train, held)  # reproducible
    assert set(design("random18", seed=1)[0]) != set(train)  # another seed, another draw
    assert set(train) != set(design()[0])  # not the published design


def test_all_is_the_243_configurations_with_the_published_held_out_set_trained_on_too():
    train, held = design("all")
    assert len({c.name for c in train}) == len(train) == 243
    assert train == all_configs() and [c.name for c in held] == PAPER_TABLE_8
    assert set(held) <= set(train)


def test_scaling_planner_trains_on_the_chosen_space_only():
    from pipeline.rollout.scheduling import Planner
    from pipeline.rollout.tasks import Task, TaskConfig

    tasks = [Task(id=f"t{i}", path=f"/t{i}", instruction="x", config=TaskConfig()) for i in range(6)]
    for space, (train, held) in (("published", design()), ("generated", design("generated"))):
        p = Planner(tasks, "scaling", "", [], 2, 6, seed=1, space=space)
        used = {a.harness.removeprefix("whitebox:") for s in range(40) for a in p.step(s)}
        assert used <= {c.name for c in train} and not used & {c.name for c in held}
        assert len(used) > 9


def test_held_out_refuses_unbalanced_training():
    with pytest.raises(ValueError, match="component S"):
        held_out_configs([HarnessConfig.parse("S0T0O0C0W0"), HarnessConfig.parse("S0T1O1C1W1")])


# ------------------------------------------------------------------------------------------ assignment
def test_assignment_by_hand():
    train = [HarnessConfig.parse(n) for n in ["S0T0O0C0W0", "S0T0O0C0W1", "S0T0O0C1W1", "S1T1O0C1W1"]]
    for seed in range(20):
        got = locality_assignment(train, 3, random.Random(seed))
        anchor = got[0]
        if anchor == train[0]:
            assert got == train[:3]  # distances 1 then 2
        if anchor == train[3]:
            assert got[1:] == [train[2], train[1]]  # distances 2 then 3 (train[0] is at 4)
    assert locality_assignment(train, 1, random.Random(0)) == [
        locality_assignment(train, 2, random.Random(0))[0]
    ]


def test_assignment_breaks_ties_with_the_rng():
    train = [HarnessConfig.parse(n) for n in ["S0T0O0C0W0", "S1T0O0C0W0", "S0T1O0C0W0"]]
    seconds = set()
    for seed in range(40):
        rng = random.Random(seed)
        got = locality_assignment(train, 2, rng)
        if got[0] == train[0]:
            seconds.add(got[1])
    assert seconds == {train[1], train[2]}  # both tied neighbours get picked for some seed


def test_assignment_anchor_covers_the_training_set():
    train = training_configs()
    rng = random.Random(7)
    anchors = Counter(locality_assignment(train, 2, rng)[0] for _ in range(2000))
    assert set(anchors) == set(train)


@given(st.integers(0, 10**6), st.integers(1, 18))
@settings(max_examples=60, deadline=None)
def test_assignment_is_the_anchor_plus_its_k_minus_1_nearest(seed, k):
    train = training_configs()
    got = locality_assignment(train, k, random.Random(seed))
    assert got == locality_assignment(train, k, random.Random(seed))  # deterministic per seed
    assert len(got) == len(set(got)) == k and set(got) <= set(train)
    anchor, chosen = got[0], got[1:]
    rest = set(train) - set(got)
    if chosen and rest:
        assert max(anchor.distance(c) for c in chosen) <= min(anchor.distance(c) for c in rest)
    assert [anchor.distance(c) for c in chosen] == sorted(anchor.distance(c) for c in chosen)


def test_assignment_rejects_bad_k():
    with pytest.raises(ValueError, match="k=19"):
        locality_assignment(training_configs(), 19, random.Random(0))


def test_random_assignment_draws_k_distinct_training_configurations_at_any_distance():
    train = [HarnessConfig.parse(n) for n in ["S0T0O0C0W0", "S0T0O0C0W1", "S2T2O2C2W2"]]
    pairs = set()
    for seed in range(60):
        got = assign(train, 2, random.Random(seed), "random")
        assert len(set(got)) == 2 and set(got) <= set(train)
        pairs.add(frozenset(got))
    # locality never pairs S0T0O0C0W0 with S2T2O2C2W2 (distance 5: its neighbour is at 1); random does
    assert frozenset({train[0], train[2]}) in pairs and len(pairs) == 3
    with pytest.raises(ValueError, match="k=4"):
        assign(train, 4, random.Random(0), "random")


def test_repeat_assignment_is_one_configuration_k_times():
    train = [HarnessConfig.parse(n) for n in PAPER_TABLE_6]
    firsts = set()
    for seed in range(200):
        got = assign(train, 3, random.Random(seed), "repeat")
        assert got == [got[0]] * 3 and got[0] in train
        firsts.add(got[0])
    assert firsts == set(train)  # drawn from the whole training set
    assert assign(train[:1], 5, random.Random(0), "repeat") == [train[0]] * 5  # K may exceed the set


def test_locality_rule_is_locality_assignment_unchanged():
    train = training_configs()
    for seed in range(20):
        assert assign(train, 3, random.Random(seed), "locality") == locality_assignment(train, 3, random.Random(seed))
    with pytest.raises(ValueError, match="'nearest'"):
        assign(train, 2, random.Random(0), "nearest")  # type: ignore[arg-type]


@given(st.integers(0, 10**6), st.integers(1, 18), st.sampled_from(["locality", "random", "repeat"]))
@settings(max_examples=60, deadline=None)
def test_every_rule_gives_k_training_configurations_reproducibly(seed, k, rule):
    train = design()[0]
    got = assign(train, k, random.Random(seed), rule)
    assert got == assign(train, k, random.Random(seed), rule) and len(got) == k and set(got) <= set(train)
    assert len(set(got)) == (1 if rule == "repeat" else k)


# --------------------------------------------------------------------------------------- tool interface
def test_tool_names_per_interface():
    t0, t1, t2 = (HarnessConfig(0, t, 0, 0, 0) for t in range(3))
    assert [tool_name_for(t0, c) for c in CANONICAL_TOOLS] == list(CANONICAL_TOOLS)
    aliases = [tool_name_for(t1, c) for c in CANONICAL_TOOLS]
    opaque = [tool_name_for(t2, c) for c in CANONICAL_TOOLS]
    assert len(set(aliases)) == len(set(opaque)) == 7
    assert not set(aliases) & set(CANONICAL_TOOLS)
    assert all(n.startswith("tool_") and not any(c in n for c in CANONICAL_TOOLS) for n in opaque)
    assert offered_tools(t0) == list(CANONICAL_TOOLS)
    distractors = set(offered_tools(t2)) - set(opaque)
    assert len(distractors) == 3 and set(opaque) <= set(offered_tools(t2))
    with pytest.raises(ValueError, match="read_file"):
        tool_name_for(t0, "open")


def test_the_space_is_the_harness_definition():
    """One definition of the components: the harness space re-exports the harness's own, it does not copy them."""
    for name in ("COMPONENTS", "LEVELS", "REALIZATIONS", "CANONICAL_TOOLS", "HarnessConfig", "offered_tools",
                 "tool_name_for"):
        assert getattr(harness_space, name) is getattr(components, name), name
    assert list(components.REALIZATIONS) == list(COMPONENTS)


@pytest.mark.parametrize("t", range(3))
def test_tool_names_agree_with_the_tool_interface(t):
    tools, to_canonical, distractors = components.tool_interface(t)
    config = HarnessConfig(0, t, 0, 0, 0)
    assert [d["function"]["name"] for d in tools] == offered_tools(config)
    assert {tool_name_for(config, c): c for c in CANONICAL_TOOLS} == to_canonical
    assert set(offered_tools(config)) == set(to_canonical) | set(distractors)
