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
each harness shows) and the conversation did not go on from it as history, or, without a label, it ends a segment
(nothing extends or continues it) and the next segment starts from its output. A main segment no compaction
explains is reported (``TreeStats.unjoined_segments``): calls the builder could not join.

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
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

import numpy as np

from pipeline.core.logs import get_logger
from pipeline.messages import (
    ModelCall,
    RolloutSummary,
    SettledRollout,
    TreeStats,
    floats,
    ids,
)

log = get_logger(component="tree")

Label = Literal["main", "subagent", "compaction"]

# How many recent calls' full histories are tried as the starting point of a call's walk.
_CANDIDATES = 16
# A compaction summary is recognized in the next segment's input by a window of its tokens (from its middle,
# where re-tokenization at the message boundary cannot change it); shorter outputs are never guessed at.
_SUMMARY_WINDOW = 16
_SUMMARY_MIN = 8


@dataclass(frozen=True)
class TreeOptions:
    """Filter settings (a ``[tree]`` config section maps onto this)."""

    max_leaves: int = 32  # a rollout with more leaves in its trained chains is discarded (over-branching)
    include_aux: bool = False  # train subagent and compaction calls too (off by default, as in the paper)

    def __post_init__(self) -> None:
        if self.max_leaves < 1:
            raise ValueError(f"tree.max_leaves must be >= 1, got {self.max_leaves}")


class Node:
    """A run of tokens in the radix tree. ``start`` is the history offset (depth) of its first token."""

    __slots__ = ("call", "children", "kept", "logprobs", "parent", "seg", "start", "tokens", "trainable")

    def __init__(
        self,
        tokens: np.ndarray,
        start: int,
        parent: Node | None,
        call: int,
        trainable: bool,
        logprobs: np.ndarray | None = None,
    ) -> None:
        self.tokens = tokens
        self.logprobs = logprobs
        self.start = start
        self.parent = parent
        self.children: list[Node] = []
        self.call = call  # the call that created it: its input remainder, or its output
        self.trainable = trainable  # output tokens (before the include/exclude decision)
        self.kept = False
        self.seg = -2  # after marking: the chain of every kept path through it, or -1 when several share it

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class CallInfo:
    """What the builder decided about one call (for stats, replay display and tests)."""

    call_id: str
    seq: int
    proxy_label: Label
    label: Label = "main"  # after structural confirmation / correction
    chain: int = -1
    # The call whose output tokens (some or all) come last in this call's input; -1: none.
    parent_call: int = -1
    extends: int = -1  # the call whose whole history this call's input extends; -1: none
    exact: bool = False  # attached at the end of an existing node (no split)
    # Attached to parent_call after a rewrite of its history the harness is known to make (REWRITES); "": none.
    rewrite: str = ""
    continued: bool = False  # a later call continues it after a rewrite: its own path is kept, not a dead leaf
    n_calls: int = 1  # calls with output on its root-to-leaf path, itself included
    included: bool = True  # its output is trainable (main, or aux with include_aux)
    leaf: bool = False  # no call extends it
    kept: bool = False  # its leaf was selected
    kept_tokens: bool = False  # some of its output is trained on a kept path
    out_end: Node | None = None  # the node holding its last output token
    input_len: int = 0
    output_len: int = 0
    min_version: int | None = None


@dataclass
class Chain:
    label: Label
    first_seq: int
    calls: list[int] = field(default_factory=list)


@dataclass
class RolloutTree:
    """One rollout's tree after filtering. ``root`` is the empty sequence; kept nodes have ``kept`` set."""

    settled: SettledRollout
    root: Node
    calls: list[CallInfo]
    chains: list[Chain]
    stats: TreeStats
    relabelled: dict[str, int]  # "proxy->structure" label corrections, e.g. {"main->subagent": 3}
    invalid: str = ""  # why the rollout is not trained ("" when it is)

    @property
    def valid(self) -> bool:
        return not self.invalid

    @property
    def rollout_id(self) -> str:
        return self.settled.request.rollout_id

    def summary(self) -> RolloutSummary:
        versions = [c.min_version for c in self.calls if c.kept_tokens and c.min_version is not None]
        return RolloutSummary(
            rollout_id=self.rollout_id,
            reward=self.settled.finished.reward,
            status=self.settled.finished.status,
            stats=self.stats,
            policy_version=min(versions) if versions else self.settled.request.policy_version,
        )


# ---------------------------------------------------------------------------------------------- matching
def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix, comparing in growing chunks so the cost follows the match, not the arrays."""
    n = min(len(b), len(a))
    lo, step = 0, 256
    while lo < n:
        hi = min(lo + step, n)
        diff = a[lo:hi] != b[lo:hi]
        k = int(diff.argmax())  # first True, or 0 when there is none
        if diff[k]:
            return lo + k
        lo, step = hi, step * 4
    return n


def _history_lcp(x: np.ndarray, cx: np.ndarray, cy: np.ndarray) -> int:
    """Common prefix of x with the history cx + cy, without concatenating."""
    l = _lcp(x, cx)
    if l < cx.shape[0]:
        return l
    return l + _lcp(x[l:], cy)


def _split(node: Node, k: int) -> Node:
    """Cut ``node`` after its first k tokens; the new head takes its place, the node keeps its end (and identity,
    so every ``out_end`` reference stays right)."""
    parent = node.parent
    assert parent is not None and 0 < k < len(node.tokens)
    head = Node(
        node.tokens[:k],
        node.start,
        parent,
        node.call,
        node.trainable,
        None if node.logprobs is None else node.logprobs[:k],
    )
    parent.children[parent.children.index(node)] = head
    head.children.append(node)
    node.parent = head
    node.tokens = node.tokens[k:]
    if node.logprobs is not None:
        node.logprobs = node.logprobs[k:]
    node.start += k
    return head


def _walk_down(node: Node, x: np.ndarray, pos: int) -> tuple[Node, int]:
    """From a node boundary, follow x down; returns (node, matched length) where the match ends inside or at the
    end of ``node``. Among children matching equally far, one matched whole wins (the walk can go on below it),
    then the most recent."""
    while pos < x.shape[0]:
        best, best_len, best_full = None, 0, False
        first = x[pos]
        for child in reversed(node.children):
            if child.tokens[0] != first:
                continue
            l = _lcp(child.tokens, x[pos:])
            full = l == len(child.tokens)
            if (l, full) > (best_len, best_full):
                best, best_len, best_full = child, l, full
        if best is None:
            break
        if best_len < len(best.tokens):
            return best, pos + best_len
        node, pos = best, pos + best_len
    return node, pos


# --------------------------------------------------------------------------------------------- building
@dataclass
class _Rec:
    call: ModelCall
    x: np.ndarray
    y: np.ndarray
    lp: np.ndarray


def _records(settled: SettledRollout, dropped: Counter[str]) -> list[_Rec]:
    seen: set[str] = set()
    out: list[_Rec] = []
    for call in sorted(settled.calls, key=lambda c: (c.seq, c.call_id)):
        if call.call_id in seen:
            dropped["duplicate_record"] += 1
            continue
        seen.add(call.call_id)
        if call.finish_reason in ("abort", "error"):
            dropped["failed_call"] += 1
            continue
        if len(call.input_ids) % 4 or len(call.output_ids) % 4 or len(call.logprobs) % 4:
            dropped["malformed_call"] += 1
            log.warning(
                "malformed_call", rollout=call.rollout_id, call=call.call_id, why="byte length not x4"
            )
            continue
        x, y, lp = ids(call.input_ids), ids(call.output_ids), floats(call.logprobs)
        if x.shape[0] == 0 or y.shape[0] == 0 or lp.shape[0] != y.shape[0]:
            dropped["malformed_call"] += 1
            log.warning(
                "malformed_call",
                rollout=call.rollout_id,
                call=call.call_id,
                input=int(x.shape[0]),
                output=int(y.shape[0]),
                logprobs=int(lp.shape[0]),
            )
            continue
        out.append(_Rec(call, x, y, lp))
    return out


def _contains(haystack: np.ndarray, needle: np.ndarray) -> bool:
    m = needle.shape[0]
    if haystack.shape[0] < m:
        return False
    starts = np.flatnonzero(haystack[: haystack.shape[0] - m + 1] == needle[0])
    for k in range(1, m):
        if starts.size == 0:
            return False
        starts = starts[haystack[starts + k] == needle[k]]
    return bool(starts.size)


# Rewrites of the previous call's history after which a call still continues it (same chain, same segment).
REWRITES = {
    # The previous input without a turn just before its generation prompt, then its output: OpenClaw ends every
    # request with an "internal context" user turn (active exec sessions, subagents) and drops it from history.
    "dropped_trailing_turn": "the previous call's last turn before its output is gone from this call's input",
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


def build_tree(settled: SettledRollout, options: TreeOptions | None = None) -> RolloutTree:
    """Build, label and filter one rollout's tree; ``invalid`` says why it will not be trained, if so."""
    options = options or TreeOptions()
    dropped: Counter[str] = Counter()
    recs = _records(settled, dropped)
    root = Node(np.zeros(0, dtype=np.int32), 0, None, -1, False)
    infos: list[CallInfo] = []
    chains: list[Chain] = []
    tokens_total = 0

    for i, rec in enumerate(recs):
        c = rec.call
        x, y = rec.x, rec.y
        tokens_total += x.shape[0] + y.shape[0]
        info = CallInfo(
            call_id=c.call_id,
            seq=c.seq,
            proxy_label=c.label,
            input_len=int(x.shape[0]),
            output_len=int(y.shape[0]),
            min_version=min((v.version for v in c.versions), default=None),
        )
        # Start from the best of a few recent histories: usually the previous call, which x extends entirely.
        # Equal matches: prefer a history x extends entirely (the walk continues below it), then the latest.
        best_l, best_full, best_j = 0, False, -1
        for j in range(i - 1, max(-1, i - 1 - _CANDIDATES), -1):
            hist_len = infos[j].input_len + infos[j].output_len
            if hist_len < best_l or (hist_len == best_l and best_full):
                continue
            l = _history_lcp(x, recs[j].x, recs[j].y)
            if (l, l == hist_len) > (best_l, best_full):
                best_l, best_full, best_j = l, l == hist_len, j
        node: Node = root
        if best_j >= 0:
            node = infos[best_j].out_end  # type: ignore[assignment]
            while node is not root and node.end > best_l:
                node = node.parent  # type: ignore[assignment]
        node, pos = _walk_down(node, x, node.end)
        existed = node is not root
        if pos < node.end:
            node = _split(node, pos - node.start)
            existed = False
        info.exact = existed

        # The nearest output on the matched path decides the chain.
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
        else:
            info.chain = len(chains)
            chains.append(Chain(label="main", first_seq=c.seq))
        chains[info.chain].calls.append(i)

        attach = node
        if pos < x.shape[0]:
            env = Node(x[pos:], pos, node, i, False)
            node.children.append(env)
            attach = env
        out = Node(y, int(x.shape[0]), attach, i, True, rec.lp)
        attach.children.append(out)
        info.out_end = out
        infos.append(info)

    relabelled: Counter[str] = Counter()
    _label(recs, infos, chains, relabelled)
    stats, invalid = _filter(settled, infos, chains, options, dropped, tokens_total)
    tree = RolloutTree(settled, root, infos, chains, stats, dict(relabelled), invalid)
    log.debug(
        "tree_built",
        rollout=settled.request.rollout_id,
        calls=stats.calls,
        leaves=stats.leaves,
        kept_leaves=stats.kept_leaves,
        invalid=invalid,
    )
    return tree


def _label(recs: list[_Rec], infos: list[CallInfo], chains: list[Chain], relabelled: Counter[str]) -> None:
    """Confirm or correct the proxy's labels from structure (see the module docstring)."""
    if not chains:
        return
    last_seq = [max(infos[i].seq for i in ch.calls) for ch in chains]
    # Calls the conversation went on from: extended exactly, or continued after a known rewrite.
    extended = {info.extends for info in infos if info.extends >= 0} | {
        n for n, info in enumerate(infos) if info.continued}
    current_main = -1
    main_chains: list[int] = []
    for k, ch in enumerate(chains):
        first = infos[ch.calls[0]].proxy_label
        if first == "compaction" and ch.calls[0] in extended:
            first = "main"  # a summary nobody read as a summary: the conversation went on from it
        if first in ("subagent", "compaction"):
            ch.label = first
        elif current_main >= 0 and last_seq[current_main] > ch.first_seq:
            ch.label = "subagent"  # the main agent carried on after it: it was a side conversation
        else:
            main_chains.append(k)
            current_main = k

    for n, info in enumerate(infos):
        chain = chains[info.chain]
        if chain.label != "main":
            info.label = chain.label
        elif info.proxy_label == "compaction" and n not in extended:
            info.label = "compaction"
        else:
            info.label = "main"

    # A main segment's last leaf whose output reappears in the next segment's first input wrote the summary.
    for a, b in pairwise(main_chains):
        if any(infos[i].label == "compaction" for i in chains[a].calls):
            continue
        last = next((i for i in reversed(chains[a].calls) if i not in extended), None)
        if last is None:
            continue
        y = recs[last].y
        if y.shape[0] >= _SUMMARY_MIN:
            w = min(_SUMMARY_WINDOW, y.shape[0])
            mid = (y.shape[0] - w) // 2
            if _contains(recs[chains[b].calls[0]].x, y[mid : mid + w]):
                infos[last].label = "compaction"

    for info in infos:
        if info.label != info.proxy_label:
            relabelled[f"{info.proxy_label}->{info.label}"] += 1


def _filter(
    settled: SettledRollout,
    infos: list[CallInfo],
    chains: list[Chain],
    options: TreeOptions,
    dropped: Counter[str],
    tokens_total: int,
) -> tuple[TreeStats, str]:
    for info in infos:
        info.included = info.label == "main" or options.include_aux
        if not info.included:
            dropped[f"{info.label}_excluded"] += 1

    extended_by_any = {info.extends for info in infos if info.extends >= 0}
    extended_by_included = {info.extends for info in infos if info.extends >= 0 and info.included}
    # Continued after a rewrite: the next call carries its output, but on a path of its own (the rewritten
    # history), so its leaf is kept beside the chain's longest one instead of counting as a dead branch.
    continued = {info.parent_call for info in infos if info.rewrite and info.included}
    leaves = 0
    trained_leaves = 0
    for n, info in enumerate(infos):
        info.leaf = n not in extended_by_any
        leaves += info.leaf
        if info.included and n not in extended_by_included and n not in continued:
            trained_leaves += 1

    kept: list[int] = []
    for chain in chains:
        cands = [n for n in chain.calls if infos[n].included and n not in extended_by_included
                 and n not in continued]
        if not cands:
            continue
        best = max(cands, key=lambda n: (infos[n].n_calls, infos[n].seq))
        kept.append(best)
        if len(cands) > 1:
            dropped["dead_leaf"] += len(cands) - 1
    kept += sorted(n for n in continued if n not in extended_by_included)

    invalid = ""
    if settled.finished.status != "ok":
        invalid = f"status {settled.finished.status}"
    elif not infos:
        invalid = "no usable calls"
    elif trained_leaves > options.max_leaves:
        invalid = f"over_branching ({trained_leaves} leaves > max_leaves {options.max_leaves})"
        dropped["over_branching"] += 1

    packed = trainable = 0
    if not invalid:
        packed, trainable = _mark_kept(infos, kept)
        if trainable == 0:
            invalid = "no trainable tokens kept"
    return _stats(infos, chains, kept, invalid, dropped, tokens_total, packed, trainable), invalid


def _mark_kept(infos: list[CallInfo], kept: list[int]) -> tuple[int, int]:
    """Mark every kept leaf's root path; (tokens packed, tokens trainable). A node shared by paths of several
    chains gets seg -1 (a prefix shared by segments, e.g. the system prompt)."""
    packed = trainable = 0
    for n in kept:
        infos[n].kept = True
        k = infos[n].chain
        node: Node | None = infos[n].out_end
        while node is not None and node.parent is not None:
            if node.kept and node.seg in (k, -1):
                break
            if not node.kept:
                node.kept = True
                node.seg = k
                packed += len(node.tokens)
                if node.trainable and infos[node.call].included:
                    trainable += len(node.tokens)
                    infos[node.call].kept_tokens = True
            else:
                node.seg = -1
            node = node.parent
    return packed, trainable


def how_attached(infos: list[CallInfo], chains: list[Chain], n: int) -> str:
    """How call n joined the tree: ``first`` (the rollout's first call), ``exact`` (its input extends an earlier
    call's whole history), ``retry`` (its input is an earlier call's input: another sample of the same turn),
    ``rewrite:<name>`` (it continues an earlier call after a known rewrite, REWRITES), ``branch`` (it continues an
    earlier call from inside its history: a truncated answer, an edit), ``root`` (a new chain: a subagent, a
    segment after compaction, or a call the builder could not join)."""
    info = infos[n]
    if n == 0:
        return "first"
    if info.rewrite:
        return f"rewrite:{info.rewrite}"
    if info.parent_call < 0:
        return "root" if chains[info.chain].calls[0] == n else "retry"
    if info.extends >= 0 and info.exact:
        return "exact"
    return "branch"


def _stats(infos: list[CallInfo], chains: list[Chain], kept: list[int], invalid: str, dropped: Counter[str],
           tokens_total: int, packed: int, trainable: int) -> TreeStats:
    attach = Counter(how_attached(infos, chains, n) for n in range(len(infos)))
    fate: Counter[str] = Counter()
    for info in infos:
        if not info.included:
            fate["auxiliary"] += 1
        elif info.kept_tokens and not invalid:
            fate["trained"] += 1
        else:
            fate["not_trained"] += 1
    main_segments = sum(1 for ch in chains if any(infos[n].label == "main" for n in ch.calls))
    compactions = sum(1 for info in infos if info.label == "compaction")
    # Every call but the rollout's first could have extended an earlier one: a rollout of new roots reads 0 %.
    attachable = len(infos) - 1
    return TreeStats(
        calls=len(infos),
        leaves=sum(info.leaf for info in infos),
        kept_leaves=0 if invalid else len(kept),
        segments=main_segments,
        depth=max((info.n_calls for info in infos), default=0),
        tokens_total=tokens_total,
        tokens_packed=packed if not invalid else 0,
        tokens_trainable=trainable if not invalid else 0,
        tokens_output=sum(info.output_len for info in infos),
        exact_prefix_attach_rate=(attach["exact"] + attach["retry"]) / attachable if attachable > 0 else 1.0,
        attach={k: v for k, v in sorted(attach.items())},
        calls_by_fate={k: v for k, v in sorted(fate.items())},
        unjoined_segments=max(0, main_segments - 1 - compactions),
        dropped={k: v for k, v in sorted(dropped.items()) if v},
    )


# ------------------------------------------------------------------------------------------------ display
def format_stats(summary: RolloutSummary, relabelled: dict[str, int] | None = None) -> str:
    """One line per rollout for ``run.py --replay --trees``."""
    s = summary.stats
    ratio = s.tokens_total / s.tokens_packed if s.tokens_packed else 0.0
    parts = [
        f"{summary.rollout_id} {summary.status} reward={summary.reward:.3f}",
        f"calls={s.calls} leaves={s.leaves} kept={s.kept_leaves} segments={s.segments} depth={s.depth}",
        (f"tokens total={s.tokens_total:,} packed={s.tokens_packed:,} "
         f"trainable={s.tokens_trainable:,}/{s.tokens_output:,} output"),
        f"shared={ratio:.1f}x",
        f"exact-attach={100 * s.exact_prefix_attach_rate:.1f}%",
        "attach " + " ".join(f"{k}={v}" for k, v in s.attach.items()),
        "calls " + " ".join(f"{k}={v}" for k, v in s.calls_by_fate.items()),
    ]
    if s.unjoined_segments:
        parts.append(f"NOT JOINED: {s.unjoined_segments} segment(s) no compaction explains")
    if s.dropped:
        parts.append("dropped " + " ".join(f"{k}={v}" for k, v in s.dropped.items()))
    if relabelled:
        parts.append("relabelled " + " ".join(f"{k}={v}" for k, v in sorted(relabelled.items())))
    return "  ".join(parts)


def format_calls(tree: RolloutTree) -> str:
    """Call-by-call view of one rollout's tree for ``run.py --replay``: one line per call, in seq order."""
    lines = []
    for n, c in enumerate(tree.calls):
        how = how_attached(tree.calls, tree.chains, n)
        state = "kept-leaf" if c.kept else ("leaf" if c.leaf else "")
        label = c.label if c.label == c.proxy_label else f"{c.label}(proxy {c.proxy_label})"
        lines.append(
            f"  seq={c.seq:<4} {c.call_id:<16} chain={c.chain:<2} {label:<10} {how:<28} "
            f"in={c.input_len:<7} out={c.output_len:<6} on-path={c.n_calls:<4} "
            f"{'trained' if c.kept_tokens else 'context'} {state}".rstrip()
        )
    return "\n".join(lines)
