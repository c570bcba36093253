"""Labels from structure: confirm or correct the proxy's main / subagent / compaction labels (docs/trees.md)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

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


def _unlabelled_summaries(recs: list[_Rec], infos: list[CallInfo], chains: list[Chain], main_chains: list[int],
                          extended: set[int]) -> None:
    """Without a label: a main segment's last leaf (nothing extends or continues it) whose output reappears in the
    next segment's first input wrote that segment's summary."""
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
