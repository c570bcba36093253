"""The prefix tree's data: nodes, what the builder decided about each call, chains; token matching helpers.

See pipeline/trees/tree.py for how a rollout's tree is built from these, and docs/trees.md for the semantics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pipeline.core.logs import get_logger
from pipeline.messages import ModelCall, RolloutSummary, SettledRollout, TreeStats, floats, ids

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
    # A compaction: the main segment (chain) that starts from its output, which confirms it; -1: unconfirmed.
    summary_for: int = -1
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
    joined_by: int = -1  # a main segment after the first: the compaction call it starts from; -1: unjoined


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
    k = _lcp(x, cx)
    if k < cx.shape[0]:
        return k
    return k + _lcp(x[k:], cy)


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
            m = _lcp(child.tokens, x[pos:])
            full = m == len(child.tokens)
            if (m, full) > (best_len, best_full):
                best, best_len, best_full = child, m, full
        if best is None:
            break
        if best_len < len(best.tokens):
            return best, pos + best_len
        node, pos = best, pos + best_len
    return node, pos



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
