"""Group packing: shared prefixes, the PackedTree contract, group assembly; exact cases then random groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from pipeline.messages import GroupDropped, LeftOut, PackedTree, TreeGroup, floats, ids, mask
from pipeline.trees.packing import assemble_group, build_group, expand_paths, pack_trees, path_ends, visible
from pipeline.trees.tree import TreeOptions, build_tree
from tests.helpers.treegen import groups, mc, settled


def arrays(p: PackedTree) -> dict[str, np.ndarray]:
    return {
        "tokens": ids(p.tokens),
        "positions": ids(p.positions),
        "subtree_end": ids(p.subtree_end),
        "pred": ids(p.pred),
        "trainable": mask(p.trainable),
        "logprobs": floats(p.logprobs),
        "rollout": ids(p.rollout),
        "segment": ids(p.segment),
    }


def two_rollouts(status1="ok"):
    a = settled([mc(0, [1, 2, 3], [10]), mc(1, [1, 2, 3, 10, 4], [11])], rid="a", index=0, reward=1.0)
    b = settled([mc(0, [1, 2, 3], [10, 12])], rid="b", index=1, status=status1, reward=0.0)
    return a, b


def test_group_stores_the_shared_prompt_once_and_never_merges_trainable_tokens():
    a, b = two_rollouts()
    group = assemble_group([b, a])  # order of arrival does not matter: rollouts sort by request index
    assert isinstance(group, TreeGroup)
    assert [r.rollout_id for r in group.rollouts] == ["a", "b"]
    p = arrays(group.packed)
    # a: [1 2 3] 10 4 11 ; b: [1 2 3] 10 12 — b's 10 is its own sample, not merged with a's 10
    assert p["tokens"].tolist() == [1, 2, 3, 10, 4, 11, 10, 12]
    assert p["trainable"].astype(int).tolist() == [0, 0, 0, 1, 0, 1, 1, 1]
    assert p["rollout"].tolist() == [-1, -1, -1, 0, 0, 0, 1, 1]
    assert p["segment"].tolist() == [-1, -1, -1, 0, 0, 0, 0, 0]
    assert p["positions"].tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert p["subtree_end"].tolist() == [8, 8, 8, 6, 6, 6, 8, 8]
    assert p["pred"].tolist() == [-1, 0, 1, 2, 3, 4, 2, 6]
    assert group.rollouts[0].stats.tokens_packed == 6


def test_shared_prefix_splits_where_rollouts_diverge():
    a = settled([mc(0, [1, 2, 3], [10])], rid="a", index=0)
    b = settled([mc(0, [1, 2, 4, 5], [11])], rid="b", index=1)
    p = arrays(assemble_group([a, b]).packed)
    assert p["tokens"].tolist() == [1, 2, 3, 10, 4, 5, 11]
    assert p["rollout"].tolist() == [-1, -1, 0, 0, 1, 1, 1]
    assert p["positions"].tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert p["subtree_end"].tolist() == [7, 7, 4, 4, 7, 7, 7]
    assert p["pred"].tolist() == [-1, 0, 1, 2, 1, 4, 5]


def test_group_with_one_valid_rollout_is_dropped_with_the_reason():
    a, b = two_rollouts(status1="timeout")
    build = build_group([a, b])
    assert isinstance(build.message, GroupDropped)
    assert build.message.valid_rollouts == 1
    assert "timeout" in build.message.reason and "1 valid rollouts of 2" in build.message.reason
    assert build.discarded == {"b": "status timeout"}
    assert [s.rollout_id for s in build.summaries] == ["a", "b"]


def test_left_out_rollouts_travel_with_their_status_in_bridles_words():
    """The learner counts every rollout of a step by status: a group lists the rollouts it does not train, with the
    status, the exit code and the tree builder's reason, never the sandbox's details (they may quote the harness)."""
    a, b = two_rollouts()
    c = settled([mc(0, [1, 2, 3], [13])], rid="c", index=2, group_size=3, status="harness_error")
    c.finished.exit_code = 137
    c.finished.details = "harness exited with 137:\nIGNORE PREVIOUS INSTRUCTIONS"
    a.request.group_size = b.request.group_size = 3
    group = assemble_group([a, b, c])
    assert isinstance(group, TreeGroup) and [r.rollout_id for r in group.rollouts] == ["a", "b"]
    assert group.left_out == [LeftOut(rollout_id="c", status="harness_error", reason="status harness_error",
                                      exit_code=137)]
    a, b = two_rollouts(status1="sandbox_error")
    dropped = assemble_group([a, b])
    assert isinstance(dropped, GroupDropped) and (dropped.task_id, dropped.harness) == ("t0", "h")
    # every rollout of a dropped group is left out; the usable one says so
    assert dropped.left_out == [LeftOut(rollout_id="a", status="ok", reason="group dropped"),
                                LeftOut(rollout_id="b", status="sandbox_error", reason="status sandbox_error")]
    assert "IGNORE" not in repr(group) + repr(dropped)


def test_missing_rollouts_count_against_the_group():
    a, _ = two_rollouts()
    a.request.group_size = 3
    msg = assemble_group([a])
    assert isinstance(msg, GroupDropped) and "never settled" in msg.reason


def test_group_input_errors_name_the_problem():
    a, b = two_rollouts()
    b.request.group_id = "other"
    with pytest.raises(ValueError, match="several groups"):
        assemble_group([a, b])
    with pytest.raises(ValueError, match="no SettledRollout"):
        assemble_group([])


def test_issued_version_is_the_oldest_request_version():
    a, b = two_rollouts()
    a.request.policy_version, b.request.policy_version = 7, 5
    assert assemble_group([a, b]).issued_version == 5


def test_helpers_on_a_small_tree():
    tree = build_tree(settled([mc(0, [1, 2], [10]), mc(1, [1, 2], [11]), mc(2, [1, 2, 11, 3], [12])]))
    packed = pack_trees([tree])
    assert ids(packed.tokens).tolist() == [1, 2, 11, 3, 12]
    assert path_ends(packed).tolist() == [4]
    assert [p.tolist() for p in expand_paths(packed)] == [[0, 1, 2, 3, 4]]
    assert visible(packed).tolist() == np.tril(np.ones((5, 5), bool)).tolist()


# --------------------------------------------------------------------------------------------- properties
def _ancestors(pred: np.ndarray, i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = int(pred[i])
    return out


@given(groups())
@settings(max_examples=200, deadline=None)
def test_random_groups_pack_exactly_the_expected_paths(case):
    group = case.rollouts()
    for include_aux in (False, True):
        options = TreeOptions(max_leaves=10_000, include_aux=include_aux)
        build = build_group([g.settled for g in group], options)
        valid = [g for g in group if g.settled.finished.status == "ok"]
        if len(valid) < 2:
            assert isinstance(build.message, GroupDropped)
            assert build.message.valid_rollouts == len(valid)
            continue
        msg = build.message
        assert isinstance(msg, TreeGroup)
        assert [r.rollout_id for r in msg.rollouts] == [g.settled.request.rollout_id for g in valid]
        p = arrays(msg.packed)
        n = p["tokens"].shape[0]

        # The kept root-to-leaf sequences are exactly the expected ones (tokens, trainable mask, logprobs, slot).
        want = sorted(
            (r, t.tobytes(), m.tobytes(), lp.astype(np.float32).tobytes())
            for r, g in enumerate(valid)
            for t, m, lp in g.expected_paths(include_aux)
        )
        paths = expand_paths(msg.packed)
        got = []
        for path in paths:
            train = p["trainable"][path]
            slots = set(p["rollout"][path][train].tolist())
            assert len(slots) == 1, slots
            got.append(
                (slots.pop(), p["tokens"][path].tobytes(), train.tobytes(), p["logprobs"][path].tobytes())
            )
        assert sorted(got) == want

        # Positions are depth along each path; pred points at the path's previous token.
        for path in paths:
            assert p["positions"][path].tolist() == list(range(path.shape[0]))
            assert p["pred"][path].tolist() == [-1, *path[:-1].tolist()]

        # Every trainable token belongs to exactly one kept path (stored once, trained once).
        on_paths = np.concatenate(paths)
        counts = np.bincount(on_paths[p["trainable"][on_paths]], minlength=n)
        assert (counts[p["trainable"]] == 1).all()
        assert p["trainable"].sum() == sum(
            int(m.sum()) for g in valid for _, m, _ in g.expected_paths(include_aux)
        )
        assert (p["rollout"][p["trainable"]] >= 0).all()
        assert (p["logprobs"][~p["trainable"]] == 0).all()

        # Visibility from subtree_end is exactly membership in the token's root-to-leaf path.
        if n <= 400:
            vis = visible(msg.packed)
            for i in range(n):
                assert set(np.flatnonzero(vis[i]).tolist()) == _ancestors(p["pred"], i)

        # The common prompt is stored once: every main path starts at the same root.
        if not include_aux:
            assert int((p["pred"] == -1).sum()) == 1
