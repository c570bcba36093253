"""The prefix tree of one rollout's model calls, and the filters that decide what is trained (docs/trees.md).

Each call i is (x_i, y_i): input ids and sampled output ids. Its accumulated history is x_i + y_i. Calls are
inserted in ``seq`` order into a radix tree (nodes hold runs of tokens, never single tokens) rooted at the empty
sequence: call i hangs at the deepest point its input shares with the tree, the rest of x_i becomes an environment
node (kept for attention, never trained) and y_i a trainable node with its logprobs. Trainable nodes are never
merged with anything, even with identical tokens: two samples are two actions.

The builder then sorts calls into *chains* (roots tied to the rollout): a call whose matched prefix contains an
earlier call's output continues that call's chain; so does a call that continues an earlier one after a rewrite
the harness is known to make (``REWRITES``: OpenClaw drops the trailing "internal context" turn of every request
before the next one; the earlier call's own path is then kept too, not treated as a dead branch). A call that
only shares environment tokens (e.g. the system prompt) starts a new chain, unless its input equals an existing
root call's input exactly (a retried first turn).
A new chain is a *subagent* when the proxy labelled it so or when the main chain it interrupted is continued later;
otherwise it is the next *segment* of the main agent (a compaction restart). The call that wrote the compaction
summary is recognized from what a compaction is: the request asked for a summary (the proxy's label, from what
each harness shows: evidence, not proof) and the conversation did not go on from it as history, or, without a
label, it ends a segment (nothing extends or continues it) and the next segment starts from its output. Each
segment after the first is then checked on its own: it must start from (contain) the output of a compaction made
after the previous segment began, which confirms that compaction (pipeline/trees/labels.py). A segment no
compaction explains (``TreeStats.unjoined_segments``) is still trained, as a segment of its own; a compaction no
segment starts from (``TreeStats.unconfirmed_compactions``) is still not trained.

Filters, each counted in ``TreeStats.dropped``: duplicated records, failed/aborted calls, malformed records,
auxiliary calls (subagent, compaction; kept as context where they are on a kept path but not trained, unless
``include_aux``), dead leaves (per chain only the longest continuation is kept: the most calls on its path, ties to
the later call), and whole rollouts with too many leaves (over-branching).

Cost: every comparison is a numpy slice comparison that stops near the first mismatch, and each call starts its
walk from the best of a few recent calls' histories rather than from the root, so building is linear in total
tokens with O(calls) Python steps in the usual shapes (a linear conversation, retries, subagents, segments).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.messages import SettledRollout
from pipeline.trees.display import format_calls, format_stats
from pipeline.trees.filters import filter_tree, how_attached
from pipeline.trees.labels import label_calls
from pipeline.trees.nodes import (
    _CANDIDATES,
    _SUMMARY_MIN,
    CallInfo,
    Chain,
    Label,
    Node,
    RolloutTree,
    TreeOptions,
    _contains,
    _history_lcp,
    _lcp,
    _Rec,
    _records,
    _split,
    _walk_down,
    log,
)

__all__ = ["REWRITES", "CallInfo", "Chain", "Label", "Node", "RolloutTree", "TreeOptions", "build_tree",
           "format_calls", "format_stats", "how_attached"]


# Rewrites of the previous call's history after which a call still continues it (same chain, same segment).
REWRITES = {
    # The previous input without a turn just before its generation prompt, then its output: OpenClaw ends every
    # request with an "internal context" user turn (active exec sessions, subagents) and drops it from history.
    "dropped_trailing_turn": "the previous call's last turn before its output is gone from this call's input",
    # The previous call answered nothing (its end-of-turn token alone) and the harness asked again from that call's
    # context without it (OpenClaw adds "The previous attempt did not produce a user-visible answer"). The empty
    # answer is kept and trained like any continued call: it is the action that made the harness ask again.
    "dropped_empty_answer": "the previous call answered nothing and this one asks again from its context",
}
_GEN_PROMPT_MAX = 8  # tokens between a removed trailing turn and the output (the generation prompt)


def _dropped_trailing_turn(x: np.ndarray, prev: _Rec, earlier: list[_Rec]) -> bool:
    """Whether ``x`` is prev's history with its trailing turn removed: prev.x = A + R + G, x = A + G + prev.y + ...,
    where G (the generation prompt) is at most a few tokens and R is a turn of the harness's own, not history: it is
    shorter than what is kept, and holds none of the outputs of the calls just before prev (``earlier``)."""
    h_x, y = prev.x, prev.y
    lcp = _lcp(x, h_x)
    if lcp >= h_x.shape[0] or lcp == 0:
        return False
    lo = max(lcp + 1, h_x.shape[0] - _GEN_PROMPT_MAX)
    for r in range(lo, h_x.shape[0] + 1):
        tail = h_x[r:]
        end = lcp + tail.shape[0] + y.shape[0]
        if end <= x.shape[0] and np.array_equal(x[lcp : lcp + tail.shape[0]], tail) and np.array_equal(
                x[lcp + tail.shape[0] : end], y):
            removed = h_x[lcp:r]
            return removed.shape[0] <= lcp and not any(
                _contains(removed, e.y) for e in earlier if e.y.shape[0] >= _SUMMARY_MIN // 2)
    return False


def _dropped_empty_answer(x: np.ndarray, label: str, prev: _Rec) -> bool:
    """Whether prev, a main-agent call, answered nothing (it stopped at its first token, the end of its turn) and
    ``x``, another main-agent request, starts from most of prev's input."""
    return (label == prev.call.label == "main" and prev.call.finish_reason == "stop" and prev.y.shape[0] == 1
            and 2 * _lcp(x, prev.x) >= prev.x.shape[0] > 0)


def build_tree(settled: SettledRollout, options: TreeOptions | None = None) -> RolloutTree:
    """Build, label and filter one rollout's tree; ``invalid`` says why it will not be trained, if so."""
    options = options or TreeOptions()
    dropped: Counter[str] = Counter()
    recs = _records(settled, dropped)
    root = Node(np.zeros(0, dtype=np.int32), 0, None, -1, False)
    infos: list[CallInfo] = []
    chains: list[Chain] = []
    for i, rec in enumerate(recs):
        c = rec.call
        info = CallInfo(call_id=c.call_id, seq=c.seq, proxy_label=c.label, input_len=int(rec.x.shape[0]),
                        output_len=int(rec.y.shape[0]),
                        min_version=min((v.version for v in c.versions), default=None))
        node, pos = _attach_point(root, recs, infos, i)
        info.exact = node is not root and pos == node.end
        if pos < node.end:
            node = _split(node, pos - node.start)
        _join_chain(info, node, pos, root, recs, infos, chains, i)
        attach = node
        if pos < rec.x.shape[0]:
            env = Node(rec.x[pos:], pos, node, i, False)
            node.children.append(env)
            attach = env
        out = Node(rec.y, int(rec.x.shape[0]), attach, i, True, rec.lp)
        attach.children.append(out)
        info.out_end = out
        infos.append(info)

    relabelled: Counter[str] = Counter()
    label_calls(recs, infos, chains, relabelled)
    tokens_total = sum(int(r.x.shape[0] + r.y.shape[0]) for r in recs)
    stats, invalid = filter_tree(settled, infos, chains, options, dropped, tokens_total)
    tree = RolloutTree(settled, root, infos, chains, stats, dict(relabelled), invalid)
    log.debug("tree_built", rollout=settled.request.rollout_id, calls=stats.calls, leaves=stats.leaves,
              kept_leaves=stats.kept_leaves, invalid=invalid)
    return tree


def _attach_point(root: Node, recs: list[_Rec], infos: list[CallInfo], i: int) -> tuple[Node, int]:
    """Where call i's input leaves the tree: (the node the match ends in, the matched length)."""
    x = recs[i].x
    # Start from the best of a few recent histories: usually the previous call, which x extends entirely.
    # Equal matches: prefer a history x extends entirely (the walk continues below it), then the latest.
    best_l, best_full, best_j = 0, False, -1
    for j in range(i - 1, max(-1, i - 1 - _CANDIDATES), -1):
        hist_len = infos[j].input_len + infos[j].output_len
        if hist_len < best_l or (hist_len == best_l and best_full):
            continue
        m = _history_lcp(x, recs[j].x, recs[j].y)
        if (m, m == hist_len) > (best_l, best_full):
            best_l, best_full, best_j = m, m == hist_len, j
    node: Node = root
    if best_j >= 0:
        node = infos[best_j].out_end  # type: ignore[assignment]
        while node is not root and node.end > best_l:
            node = node.parent  # type: ignore[assignment]
    return _walk_down(node, x, node.end)


def _join_chain(info: CallInfo, node: Node, pos: int, root: Node, recs: list[_Rec], infos: list[CallInfo],
                chains: list[Chain], i: int) -> None:
    """Which chain call i continues (the nearest output on its matched path, a retried first turn, a known
    rewrite), or a new one."""
    x = recs[i].x
    t: Node | None = node
    while t is not None and t is not root and not t.trainable:
        t = t.parent
    if t is not None and t is not root:
        info.parent_call = t.call
        info.n_calls = infos[t.call].n_calls + 1
        info.chain = infos[t.call].chain
        if infos[t.call].out_end is t:
            info.extends = t.call
    elif pos == x.shape[0] and (sib := [ch for ch in node.children if ch.trainable]):
        # Same input as an earlier root call: a retried first turn.
        info.chain = infos[sib[-1].call].chain
    elif (j := next((j for j in range(i - 1, max(-1, i - 1 - _CANDIDATES), -1)
                     if _dropped_trailing_turn(x, recs[j], recs[max(0, j - 3):j])), -1)) >= 0:
        info.parent_call, info.rewrite = j, "dropped_trailing_turn"
        info.n_calls = infos[j].n_calls + 1
        info.chain = infos[j].chain
        infos[j].continued = True
    elif i > 0 and _dropped_empty_answer(x, recs[i].call.label, recs[i - 1]):
        info.parent_call, info.rewrite = i - 1, "dropped_empty_answer"
        info.n_calls = infos[i - 1].n_calls + 1
        info.chain = infos[i - 1].chain
        infos[i - 1].continued = True
    else:
        info.chain = len(chains)
        chains.append(Chain(label="main", first_seq=recs[i].call.seq))
    chains[info.chain].calls.append(i)
