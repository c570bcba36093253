"""Prefix-tree building and filters: small cases checked by hand, then random rollouts (tests/helpers/treegen.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import (
    VersionSpan,
    floats,
    ids,
    mask,
)
from pipeline.trees.packing import pack_trees
from pipeline.trees.tree import TreeOptions, build_tree, format_calls, format_stats
from tests.helpers.treegen import Spec, generate, mc, settled, specs

S = 900  # summary marker in the compaction case


def packed_of(*calls, options=None):
    tree = build_tree(settled(list(calls)), options)
    assert tree.valid, tree.invalid
    p = pack_trees([tree])
    return tree, {
        "tokens": ids(p.tokens).tolist(),
        "positions": ids(p.positions).tolist(),
        "subtree_end": ids(p.subtree_end).tolist(),
        "pred": ids(p.pred).tolist(),
        "trainable": mask(p.trainable).astype(int).tolist(),
        "logprobs": floats(p.logprobs),
        "rollout": ids(p.rollout).tolist(),
        "segment": ids(p.segment).tolist(),
    }


LINEAR = [
    mc(0, [1, 2, 3], [10, 11]),
    mc(1, [1, 2, 3, 10, 11, 4, 5], [12]),
    mc(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14]),
]


def test_linear_conversation():
    tree, p = packed_of(*LINEAR)
    assert p["tokens"] == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert p["trainable"] == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert p["positions"] == list(range(11))
    assert p["subtree_end"] == [11] * 11
    assert p["pred"] == list(range(-1, 10))
    assert p["rollout"] == [0] * 11
    assert p["segment"] == [0] * 11
    want_lp = [0, 0, 0, -0.1, -0.11, 0, 0, -0.2, 0, -0.3, -0.31]
    np.testing.assert_allclose(p["logprobs"], want_lp, rtol=1e-6)
    s = tree.stats
    assert (s.calls, s.leaves, s.kept_leaves, s.segments, s.depth) == (1 * 3, 1, 1, 1, 3)
    assert (s.tokens_total, s.tokens_packed, s.tokens_trainable) == (5 + 8 + 11, 11, 5)
    assert s.exact_prefix_attach_rate == 1.0
    assert s.dropped == {}


def test_out_of_order_and_duplicated_records_give_the_same_tree():
    _, want = packed_of(*LINEAR)
    tree, got = packed_of(LINEAR[2], LINEAR[0], LINEAR[1], LINEAR[0], LINEAR[2])
    assert {k: v for k, v in got.items() if k != "logprobs"} == {
        k: v for k, v in want.items() if k != "logprobs"
    }
    np.testing.assert_array_equal(got["logprobs"], want["logprobs"])
    assert tree.stats.calls == 3
    assert tree.stats.tokens_total == 24  # each call counted once
    assert tree.stats.dropped == {"duplicate_record": 2}


def test_retried_turn_leaves_a_dead_leaf():
    tree, p = packed_of(
        mc(0, [1, 2], [10, 11]),
        mc(1, [1, 2], [20]),  # retry of the first turn; the harness continues from it
        mc(2, [1, 2, 20, 3], [21]),
    )
    assert p["tokens"] == [1, 2, 20, 3, 21]
    assert p["trainable"] == [0, 0, 1, 0, 1]
    s = tree.stats
    assert (s.leaves, s.kept_leaves, s.segments, s.depth) == (2, 1, 1, 2)
    assert s.dropped == {"dead_leaf": 1}
    assert s.exact_prefix_attach_rate == 1.0  # the retry attaches at the end of the prompt node
    assert [c.kept for c in tree.calls] == [False, False, True]


def test_retry_of_the_last_turn_keeps_the_later_sample():
    tree, p = packed_of(
        mc(0, [1, 2], [10]),
        mc(1, [1, 2, 10, 3], [11, 11]),
        mc(2, [1, 2, 10, 3], [11, 11]),  # same tokens sampled again: still its own trainable span
    )
    assert p["tokens"] == [1, 2, 10, 3, 11, 11]
    np.testing.assert_allclose(p["logprobs"][-2:], [-0.3, -0.31], rtol=1e-6)
    assert tree.stats.dropped == {"dead_leaf": 1}


def test_failed_and_malformed_calls_are_dropped_with_reasons():
    bad_lp = mc(3, [1, 2, 10, 3], [11, 12], lp=[-0.1])
    tree, p = packed_of(
        mc(0, [1, 2], [10]),
        mc(1, [1, 2, 10, 3], [50, 51], finish="abort"),
        mc(2, [1, 2, 10, 3], [11]),
        bad_lp,
    )
    assert p["tokens"] == [1, 2, 10, 3, 11]
    assert tree.stats.dropped == {"failed_call": 1, "malformed_call": 1}


def test_call_extending_a_node_that_is_not_the_latest():
    tree, p = packed_of(
        mc(0, [1], [10]),
        mc(1, [1, 10, 2], [11]),
        mc(2, [1, 10, 2, 11, 3], [12]),
        mc(3, [1, 10, 2, 11, 4], [13]),  # back to the state after call 1
        mc(4, [1, 10, 2, 11, 3, 12, 5], [14]),  # and on from call 2 again: the deepest path wins
    )
    assert p["tokens"] == [1, 10, 2, 11, 3, 12, 5, 14]
    assert [c.extends for c in tree.calls] == [-1, 0, 1, 1, 2]
    assert [c.exact for c in tree.calls] == [False, True, True, True, True]
    assert tree.stats.dropped == {"dead_leaf": 1}
    assert (tree.stats.leaves, tree.stats.depth) == (2, 4)


def test_branch_inside_an_output_splits_it_and_keeps_the_sampled_prefix_trainable():
    tree, p = packed_of(
        mc(0, [1], [10, 11, 12]),
        mc(1, [1, 10, 11, 5], [13]),  # the harness sent back only part of the answer
    )
    assert p["tokens"] == [1, 10, 11, 5, 13]
    assert p["trainable"] == [0, 1, 1, 0, 1]
    np.testing.assert_allclose(p["logprobs"], [0, -0.1, -0.11, 0, -0.2], rtol=1e-6)
    assert tree.calls[1].parent_call == 0 and tree.calls[1].extends == -1
    assert tree.stats.exact_prefix_attach_rate == 0.0
    assert tree.stats.dropped == {"dead_leaf": 1}


SUMMARY = list(range(50, 58))
COMPACTION = [
    mc(0, [1, 2], [10, 11]),
    mc(1, [1, 2, 10, 11, 3], [12]),
    mc(2, [1, 2, 10, 11, 3, 12, 7], SUMMARY, label="compaction"),
    mc(3, [1, 2, S, *SUMMARY], [13]),
    mc(4, [1, 2, S, *SUMMARY, 13, 4], [14]),
]


@pytest.mark.parametrize("proxy_label", ["compaction", "main"])
def test_compaction_makes_two_segments_and_the_summary_call_is_not_trained(proxy_label):
    calls = list(COMPACTION)
    calls[2] = mc(2, [1, 2, 10, 11, 3, 12, 7], SUMMARY, label=proxy_label)
    tree, p = packed_of(*calls)
    assert p["tokens"] == [1, 2, 10, 11, 3, 12, S, *SUMMARY, 13, 4, 14]
    assert p["trainable"] == [0, 0, 1, 1, 0, 1, 0, *[0] * 8, 1, 0, 1]
    assert p["positions"] == [0, 1, 2, 3, 4, 5, *range(2, 2 + 12)]
    assert p["subtree_end"] == [18, 18, 6, 6, 6, 6, *[18] * 12]
    assert p["pred"][6] == 1  # the new segment's first token is predicted from the shared prompt's last token
    assert p["segment"] == [-1, -1, 0, 0, 0, 0, *[1] * 12]
    assert [c.label for c in tree.calls] == ["main", "main", "compaction", "main", "main"]
    assert [c.chain for c in tree.calls] == [0, 0, 0, 1, 1]
    s = tree.stats
    assert (s.segments, s.kept_leaves, s.leaves) == (2, 2, 2)
    assert s.dropped == {"compaction_excluded": 1}
    assert tree.relabelled == ({} if proxy_label == "compaction" else {"main->compaction": 1})


def test_a_compaction_is_confirmed_by_the_segment_that_starts_from_its_summary():
    tree = build_tree(settled(COMPACTION))
    assert tree.calls[2].summary_for == 1 and tree.chains[1].joined_by == 2
    assert (tree.stats.unjoined_segments, tree.stats.unconfirmed_compactions) == (0, 0)


def test_a_labelled_compaction_at_the_end_is_unconfirmed_and_not_trained():
    # the harness asked for a summary, then the rollout ended: nothing read it
    tree, p = packed_of(*COMPACTION[:3])
    assert [c.label for c in tree.calls] == ["main", "main", "compaction"] and tree.calls[2].summary_for == -1
    s = tree.stats
    assert (s.segments, s.unjoined_segments, s.unconfirmed_compactions) == (1, 0, 1)
    assert s.calls_by_fate == {"auxiliary": 1, "trained": 2} and s.dropped == {"compaction_excluded": 1}
    assert p["tokens"] == [1, 2, 10, 11, 3, 12] and s.tokens_trainable == 3
    assert "UNCONFIRMED: 1 compaction(s)" in format_stats(tree.summary())
    assert "compaction?" in format_calls(tree)


def test_a_labelled_compaction_the_next_segment_does_not_start_from_is_reported_with_that_segment():
    other = [60, 61, 62, 63, 64, 65, 66, 67]  # the new segment carries some other text, not the summary
    tree, _ = packed_of(*COMPACTION[:3], mc(3, [1, 2, S, *other], [13]), mc(4, [1, 2, S, *other, 13, 4], [14]))
    assert [c.label for c in tree.calls] == ["main", "main", "compaction", "main", "main"]
    assert tree.calls[2].summary_for == -1 and tree.chains[1].joined_by == -1
    s = tree.stats
    assert (s.segments, s.unjoined_segments, s.unconfirmed_compactions) == (2, 1, 1)
    # the unjoined segment is still trained (a segment of its own); the summary is not
    assert s.calls_by_fate == {"auxiliary": 1, "trained": 4} and s.tokens_trainable == 5
    line = format_stats(tree.summary())
    assert "NOT JOINED: 1 segment(s)" in line and "UNCONFIRMED: 1 compaction(s)" in line


SUMMARY2 = list(range(70, 78))
THREE_SEGMENTS = [
    *COMPACTION,
    mc(5, [1, 2, S, *SUMMARY, 13, 4, 14, 7], SUMMARY2, label="compaction"),
]


def test_each_segment_is_checked_not_counted():
    # two compactions and three segments, but the third segment starts from the FIRST summary again: the second
    # compaction explains nothing (counting segments - 1 - compactions would have said all is joined)
    tree = build_tree(settled([*THREE_SEGMENTS, mc(6, [1, 2, S, *SUMMARY, 8], [15])]))
    assert [c.chain for c in tree.calls] == [0, 0, 0, 1, 1, 1, 2]
    assert [c.summary_for for c in tree.calls] == [-1, -1, 1, -1, -1, -1, -1]
    assert [ch.joined_by for ch in tree.chains] == [-1, 2, -1]
    s = tree.stats
    assert (s.segments, s.unjoined_segments, s.unconfirmed_compactions) == (3, 1, 1)
    # the same with the second summary: every segment joined, both compactions confirmed
    tree = build_tree(settled([*THREE_SEGMENTS, mc(6, [1, 2, S, *SUMMARY2], [15])]))
    assert [ch.joined_by for ch in tree.chains] == [-1, 2, 5]
    assert (tree.stats.unjoined_segments, tree.stats.unconfirmed_compactions) == (0, 0)


def test_a_labelled_summary_written_in_a_separate_context_is_confirmed_by_the_next_segment():
    calls = [
        mc(0, [1, 2], [10, 11]),
        mc(1, [6, 1, 2, 10, 11], SUMMARY, label="compaction"),  # its own root
        mc(2, [1, 2, S, *SUMMARY], [13]),
    ]
    tree = build_tree(settled(calls))
    assert [c.chain for c in tree.calls] == [0, 1, 2] and tree.chains[1].label == "compaction"
    assert tree.calls[1].summary_for == 2 and tree.chains[2].joined_by == 1
    assert (tree.stats.segments, tree.stats.unjoined_segments, tree.stats.unconfirmed_compactions) == (2, 0, 0)
    calls[2] = mc(2, [1, 2, S, 60, 61, 62], [13])  # ... and not confirmed by one that does not carry it
    tree = build_tree(settled(calls))
    assert tree.calls[1].label == "compaction" and tree.calls[1].summary_for == -1
    assert (tree.stats.segments, tree.stats.unjoined_segments, tree.stats.unconfirmed_compactions) == (2, 1, 1)


def test_compaction_call_can_be_included():
    tree, p = packed_of(*COMPACTION, options=TreeOptions(include_aux=True))
    assert p["tokens"][:15] == [1, 2, 10, 11, 3, 12, 7, *SUMMARY]
    assert p["trainable"][7:15] == [1] * 8
    assert tree.stats.dropped == {}


def test_compaction_label_is_corrected_when_the_conversation_continues_after_it():
    tree, _ = packed_of(mc(0, [1], [10], label="compaction"), mc(1, [1, 10, 2], [11]))
    assert [c.label for c in tree.calls] == ["main", "main"]
    assert tree.relabelled == {"compaction->main": 1}


def test_summary_written_in_a_separate_context_is_recognized():
    tree, p = packed_of(
        mc(0, [1, 2], [10, 11]),
        mc(1, [6, 1, 2, 10, 11], SUMMARY),  # "summarize this conversation": its own root, proxy says main
        mc(2, [1, 2, S, *SUMMARY], [13]),
    )
    assert [c.label for c in tree.calls] == ["main", "compaction", "main"]
    assert [c.chain for c in tree.calls] == [0, 1, 2]
    assert p["tokens"] == [1, 2, 10, 11, S, *SUMMARY, 13]
    assert tree.stats.segments == 2
    assert tree.stats.dropped == {"compaction_excluded": 1}


def test_subagent_label_on_a_call_that_continues_the_main_history_is_corrected():
    tree, p = packed_of(mc(0, [1], [10]), mc(1, [1, 10, 2], [11], label="subagent"))
    assert [c.label for c in tree.calls] == ["main", "main"]
    assert tree.relabelled == {"subagent->main": 1}
    assert p["trainable"] == [0, 1, 0, 1]


SUBAGENT = [
    mc(0, [1, 2], [10]),
    mc(1, [7, 8], [30], label="subagent"),
    mc(2, [7, 8, 30, 9], [31], label="subagent"),
    mc(3, [1, 2, 10, 3], [11]),
]


@pytest.mark.parametrize("proxy_label", ["subagent", "main"])
def test_subagent_is_its_own_root_and_excluded(proxy_label):
    calls = [
        mc(c.seq, ids(c.input_ids), ids(c.output_ids), label=proxy_label if c.label != "main" else "main")
        for c in SUBAGENT
    ]
    tree, p = packed_of(*calls)
    assert p["tokens"] == [1, 2, 10, 3, 11]
    assert [c.label for c in tree.calls] == ["main", "subagent", "subagent", "main"]
    assert tree.stats.dropped == {"subagent_excluded": 2}
    assert tree.stats.segments == 1
    assert tree.relabelled == ({} if proxy_label == "subagent" else {"main->subagent": 2})


def test_a_labelled_side_call_before_the_main_agent_starts_is_not_main():
    tree, p = packed_of(mc(0, [7], [30], label="subagent"), mc(1, [1], [10]), mc(2, [1, 10, 2], [11]))
    assert [c.label for c in tree.calls] == ["subagent", "main", "main"]
    assert p["tokens"] == [1, 10, 2, 11]
    assert tree.stats.segments == 1


def test_subagent_included_sharing_the_system_prompt():
    tree, p = packed_of(
        mc(0, [1, 2], [10]),
        mc(1, [1, 5], [30], label="subagent"),
        mc(2, [1, 2, 10, 3], [11]),
        options=TreeOptions(include_aux=True),
    )
    assert p["tokens"] == [1, 2, 10, 3, 11, 5, 30]
    assert p["trainable"] == [0, 0, 1, 0, 1, 0, 1]
    assert p["positions"] == [0, 1, 2, 3, 4, 1, 2]
    assert p["subtree_end"] == [7, 5, 5, 5, 5, 7, 7]
    assert p["pred"] == [-1, 0, 1, 2, 3, 0, 5]
    assert p["segment"] == [-1, 0, 0, 0, 0, 1, 1]
    assert tree.stats.kept_leaves == 2
    assert tree.calls[1].exact is False  # it split the prompt


def test_over_branching_discards_the_rollout():
    calls = [mc(0, [1], [10])] + [mc(k, [1], [10 + k]) for k in range(1, 6)]
    tree = build_tree(settled(calls), TreeOptions(max_leaves=3))
    assert not tree.valid and tree.invalid.startswith("over_branching")
    assert tree.stats.leaves == 6 and tree.stats.kept_leaves == 0
    assert tree.stats.dropped["over_branching"] == 1
    assert build_tree(settled(calls), TreeOptions(max_leaves=6)).valid


def test_failed_rollout_and_empty_rollout_are_invalid_with_reasons():
    assert build_tree(settled(LINEAR, status="timeout")).invalid == "status timeout"
    assert build_tree(settled([])).invalid == "no usable calls"
    assert build_tree(settled([mc(0, [1], [2], finish="error")])).invalid == "no usable calls"


def test_policy_version_is_the_oldest_kept_version():
    calls = [
        mc(0, [1], [10, 11], versions=[VersionSpan(0, 4), VersionSpan(1, 5)]),
        mc(1, [1, 10, 11, 2], [12]),
    ]
    tree = build_tree(settled(calls, version=3))
    assert tree.summary().policy_version == 4
    assert build_tree(settled(LINEAR, version=3)).summary().policy_version == 3


def test_format_stats_and_calls():
    tree = build_tree(settled(COMPACTION))
    line = format_stats(tree.summary(), tree.relabelled)
    assert "calls=5" in line and "segments=2" in line and "compaction_excluded=1" in line
    view = format_calls(tree)
    assert len(view.splitlines()) == 5 and "kept-leaf" in view


def test_options_are_validated():
    with pytest.raises(ValueError, match="max_leaves"):
        TreeOptions(max_leaves=0)


# --------------------------------------------------------------------------------------------- properties
@given(specs(), st.integers(0, 2**32 - 1))
@settings(max_examples=150, deadline=None)
def test_random_rollouts_have_consistent_stats(spec: Spec, seed: int):
    rng = np.random.default_rng(seed)
    gen = generate(rng, spec, prompt=np.array([3000, 1, 2], dtype=np.int32))
    tree = build_tree(gen.settled, TreeOptions(max_leaves=10_000))
    live = gen.live
    s = tree.stats
    assert s.calls == len(live)
    assert s.tokens_total == sum(c.x.shape[0] + c.y.shape[0] for c in live)
    assert s.dropped.get("failed_call", 0) == sum(c.aborted for c in gen.calls)
    assert s.dropped.get("duplicate_record", 0) == len(gen.settled.calls) - len(gen.calls)
    assert s.segments == len({c.chain for c in live if c.label != "subagent"})
    assert (s.unjoined_segments, s.unconfirmed_compactions) == (0, 0)  # every compaction starts the next segment
    assert [c.label for c in tree.calls] == [c.label for c in live]
    assert s.kept_leaves == len(gen.expected_paths())
    assert s.tokens_trainable == sum(int(t.sum()) for _, t, _ in gen.expected_paths())
    assert 0.0 <= s.exact_prefix_attach_rate <= 1.0


# ------------------------------------------------------------------------------- rewrites harnesses make
A, G = [1, 2, 3], [7]  # shared prompt; the generation prompt before every assistant turn
COMB = [  # OpenClaw's shape: every request ends with a context turn (90, k) that the next request no longer has
    mc(0, A + [90, 0] + G, [10, 11]),
    mc(1, A + G + [10, 11, 5] + [90, 1] + G, [12]),
    mc(2, A + G + [10, 11, 5] + G + [12, 6] + [90, 2] + G, [13]),
]


def test_a_dropped_trailing_turn_continues_the_segment_and_trains_every_call():
    tree, p = packed_of(*COMB)
    assert p["tokens"] == [1, 2, 3, 90, 0, 7, 10, 11, 7, 10, 11, 5, 90, 1, 7, 12, 7, 12, 6, 90, 2, 7, 13]
    # each output trained once, in the context the policy saw (with its own context turn); later copies are context
    assert p["trainable"] == [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    assert p["positions"] == [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8, 9, 10, 7, 8, 9, 10, 11, 12, 13]
    assert p["subtree_end"] == [23, 23, 23, *[8] * 5, 23, 23, 23, 23, 16, 16, 16, 16, *[23] * 7]
    assert p["pred"][8] == 2 and p["pred"][16] == 11  # branches predicted from their parents' last tokens
    assert [c.chain for c in tree.calls] == [0, 0, 0] and [c.label for c in tree.calls] == ["main"] * 3
    s = tree.stats
    assert s.attach == {"first": 1, "rewrite:dropped_trailing_turn": 2}
    assert s.calls_by_fate == {"trained": 3} and s.tokens_trainable == s.tokens_output == 4
    assert (s.segments, s.kept_leaves, s.unjoined_segments) == (1, 3, 0) and s.dropped == {}
    assert tree.relabelled == {}


def test_a_removed_span_that_is_history_is_not_that_rewrite_and_is_reported_unjoined():
    # the "turn" removed is longer than what was kept: not a context turn of the harness's own
    tree, _ = packed_of(mc(0, A + [90] * 5 + G, [10, 11]), mc(1, A + G + [10, 11, 5] + [91] + G, [12]))
    s = tree.stats
    assert s.attach == {"first": 1, "root": 1} and s.segments == 2 and s.unjoined_segments == 1
    assert "NOT JOINED: 1 segment(s)" in format_stats(tree.summary())


def test_an_empty_answer_asked_again_continues_the_segment_and_is_trained():
    """OpenClaw after a first answer of the end-of-turn token alone: that answer is gone, a user turn asks again."""
    END = 99
    tree, p = packed_of(mc(0, A + [90, 0] + G, [END]), mc(1, A + [80, 81] + [90, 1] + G, [12, 13]))
    s = tree.stats
    assert s.attach == {"first": 1, "rewrite:dropped_empty_answer": 1}
    assert (s.segments, s.unjoined_segments) == (1, 0) and [c.chain for c in tree.calls] == [0, 0]
    assert s.calls_by_fate == {"trained": 2} and s.dropped == {} and s.kept_leaves == 2
    assert p["tokens"] == [*A, 90, 0, *G, END, 80, 81, 90, 1, *G, 12, 13]
    assert p["trainable"] == [0] * (len(A) + 2 + len(G)) + [1] + [0] * (4 + len(G)) + [1, 1]
    # an answer that said something is not dropped by a harness: the same shape is a new, unexplained segment
    tree, _ = packed_of(mc(0, A + [90, 0] + G, [10, END]), mc(1, A + [80, 81] + [90, 1] + G, [12, 13]))
    assert tree.stats.unjoined_segments == 1


def test_a_recorded_openclaw_rollout_trains_every_tool_call():
    """tests/data/openclaw-3-tools.calls.msgpack.gz: OpenClaw 2026.9.6 writing three files through the proxy. The
    builder used to make each call a new root and relabel three of them compaction: 7 of 88 output tokens trained."""
    import gzip
    from pathlib import Path

    import msgspec

    from pipeline.messages import ModelCall

    raw = (Path(__file__).resolve().parents[1] / "data" / "openclaw-3-tools.calls.msgpack.gz").read_bytes()
    calls = msgspec.msgpack.decode(gzip.decompress(raw), type=list[ModelCall])
    tree = build_tree(settled(calls, reward=1.0))
    s = tree.stats
    assert s.calls == 4 and s.calls_by_fate == {"trained": 4}
    assert s.attach == {"first": 1, "rewrite:dropped_trailing_turn": 3}
    assert s.tokens_trainable == s.tokens_output == 88 and s.segments == 1 and tree.relabelled == {}
