"""Labels from structure: confirm or correct the proxy's main / subagent / compaction labels (docs/trees.md).

The proxy's label is evidence, not proof. A compaction is what it does: the request asked for a summary and a
later main segment starts from that summary. So every compaction call is checked against the segments after it:
a later segment whose first input contains its output confirms it (``CallInfo.summary_for``), and every main
segment after the first must start from a confirmed compaction's output (``Chain.joined_by``); what stays
unexplained is reported (``TreeStats.unconfirmed_compactions``, ``TreeStats.unjoined_segments``).
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np

from pipeline.trees.nodes import _SUMMARY_MIN, _SUMMARY_WINDOW, CallInfo, Chain, _contains, _Rec


def label_calls(recs: list[_Rec], infos: list[CallInfo], chains: list[Chain], relabelled: Counter[str]) -> None:
    """Confirm or correct the proxy's labels from structure (see pipeline/trees/tree.py's docstring)."""
    if not chains:
        return
    # Calls the conversation went on from: extended exactly, or continued after a known rewrite.
    extended = {info.extends for info in infos if info.extends >= 0} | {
        n for n, info in enumerate(infos) if info.continued}
    main_chains = _chain_labels(infos, chains, extended)
    for n, info in enumerate(infos):
        chain = chains[info.chain]
        if chain.label != "main":
            info.label = chain.label
        elif info.proxy_label == "compaction" and n not in extended:
            info.label = "compaction"
        else:
            info.label = "main"
    _unlabelled_summaries(recs, infos, chains, main_chains, extended)
    _join_segments(recs, infos, chains)
    for info in infos:
        if info.label != info.proxy_label:
            relabelled[f"{info.proxy_label}->{info.label}"] += 1


def _chain_labels(infos: list[CallInfo], chains: list[Chain], extended: set[int]) -> list[int]:
    """Label each chain from its first call and its place in time; returns the main chains (the segments)."""
    last_seq = [max(infos[i].seq for i in ch.calls) for ch in chains]
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
    return main_chains


def _summary_in(y: np.ndarray, x: np.ndarray, minimum: int) -> bool:
    """Whether x carries the output y: a window from y's middle, where re-tokenization at the message boundary
    cannot change it. Outputs shorter than ``minimum`` never match."""
    if y.shape[0] < max(1, minimum):
        return False
    w = min(_SUMMARY_WINDOW, y.shape[0])
    mid = (y.shape[0] - w) // 2
    return _contains(x, y[mid : mid + w])


def _summaries_for(recs: list[_Rec], infos: list[CallInfo], prev: Chain, seg: Chain) -> list[int]:
    """The compaction calls made after segment ``prev`` began and before ``seg`` did whose output ``seg``'s first
    input carries, in seq order."""
    after, head = infos[prev.calls[0]].seq, seg.calls[0]
    return [n for n, info in enumerate(infos) if info.label == "compaction" and after < info.seq < infos[head].seq
            and _summary_in(recs[n].y, recs[head].x, 1)]


def _unlabelled_summaries(recs: list[_Rec], infos: list[CallInfo], chains: list[Chain], main_chains: list[int],
                          extended: set[int]) -> None:
    """Without a label: a main segment's last leaf (nothing extends or continues it) whose output reappears in the
    next segment's first input wrote that segment's summary. Segments a labelled compaction starts are left
    alone."""
    for a, b in pairwise(main_chains):
        if _summaries_for(recs, infos, chains[a], chains[b]):
            continue
        last = next((i for i in reversed(chains[a].calls) if i not in extended and infos[i].label == "main"), None)
        if last is not None and _summary_in(recs[last].y, recs[chains[b].calls[0]].x, _SUMMARY_MIN):
            infos[last].label = "compaction"


def _join_segments(recs: list[_Rec], infos: list[CallInfo], chains: list[Chain]) -> None:
    """Join each main segment after the first to the compaction it starts from (``_summaries_for``; the latest,
    if several), which confirms that compaction. A compaction no next segment starts from stays a compaction (the
    request asked for a summary: its tokens are auxiliary, not trained without ``include_aux``) but unconfirmed; a
    segment no compaction explains stays a segment of its own (trained) but unjoined."""
    segments = [k for k, ch in enumerate(chains)
                if ch.label == "main" and any(infos[i].label == "main" for i in ch.calls)]
    for prev, k in pairwise(segments):
        for n in _summaries_for(recs, infos, chains[prev], chains[k]):
            chains[k].joined_by = n
            infos[n].summary_for = k
