"""The embedded engine's prefix cache: keys and values of token sequences already computed, shared by requests.

Agent harnesses send their whole conversation on every call, and each call of a rollout extends the previous call's
prompt and output; the rollouts of a group share their system prompt. A request looks up the longest cached prefix
of its prompt (:meth:`PrefixCache.match`) and computes only the rest; its prompt's KV, and its prompt and output's
when it finishes, go back in (:meth:`PrefixCache.insert`).

A radix tree over token ids (the model's own ids): each edge holds a run of tokens and their KV, one
``(keys, values)`` pair per layer of shape ``[1, kv heads, tokens, head dim]``. Every stored tensor is a copy that
nothing else references, so the bytes counted are the bytes held, and no later use can write into it (a
``DynamicCache`` built from cached KV copies it, and appends by ``torch.cat``). The tree holds at most
``budget_bytes``: an insert that goes over evicts leaves, least recently used first, never a node a request holds
(:meth:`PrefixCache.hold`) while it is prefilled. The decode thread alone uses it (no locks); :meth:`info` may be
read from another thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.serving.embedded.runner import KV


@dataclass(eq=False)
class Node:
    """One edge of the tree: ``ids`` follow the parent's tokens, ``kv`` holds their keys and values."""

    ids: list[int]
    kv: KV
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)  # by first token
    last_use: int = 0
    holders: int = 0  # requests being prefilled from this node or one below it
    nbytes: int = 0


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a sequence: its first ``length`` tokens, ending exactly at ``node``."""

    length: int
    node: Node


def _nbytes(kv: KV) -> int:
    return sum(t.untyped_storage().nbytes() for pair in kv for t in pair)


def _slice(kv: KV, start: int, stop: int | None = None) -> KV:
    """Tokens [start, stop) of ``kv``, as tensors of their own (a view would keep its whole source alive)."""
    return [(k[:, :, start:stop].clone(memory_format=torch.contiguous_format),
             v[:, :, start:stop].clone(memory_format=torch.contiguous_format)) for k, v in kv]


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))


class PrefixCache:
    """A byte-bounded radix tree of KV by token-id prefix (see the module docstring). ``budget_bytes = 0``: off."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.root = Node(ids=[], kv=[], parent=None)
        self.bytes = 0
        self.tokens = 0
        self.nodes = 0
        self.evicted_nodes = 0
        self.evicted_tokens = 0
        self.flushes = 0
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> Match:
        """The longest cached prefix of ``ids``. A match that ends inside an edge splits it there, so that the
        match ends at a node and stays valid whatever is inserted later."""
        node, n, now = self.root, 0, next(self._clock)
        while n < len(ids) and (child := node.children.get(ids[n])) is not None:
            k = _shared(child.ids, ids[n:])
            if k < len(child.ids):
                child = self._split(child, k)
            node, n = child, n + k
            node.last_use = now
        return Match(n, node)

    def kv(self, m: Match) -> KV | None:
        """The matched prefix's KV as new tensors ([1, H, length, D] per layer); None for an empty match."""
        if m.length == 0:
            return None
        path = []
        node: Node | None = m.node
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        return [(torch.cat([p.kv[i][0] for p in path], dim=2), torch.cat([p.kv[i][1] for p in path], dim=2))
                for i in range(len(path[0].kv))]

    def hold(self, m: Match) -> None:
        """Keep ``m``'s nodes from eviction until :meth:`release`."""
        self._add_holders(m.node, 1)

    def release(self, m: Match) -> None:
        self._add_holders(m.node, -1)

    def _add_holders(self, node: Node | None, d: int) -> None:
        while node is not None:
            node.holders += d
            node = node.parent

    def insert(self, ids: Sequence[int], kv: KV) -> int:
        """Cache ``ids`` with their KV (``kv`` covers all of them); returns how many tokens were new. New tokens
        that alone exceed the budget are not stored; otherwise least recently used leaves are evicted to fit."""
        if not self.budget or not ids:
            return 0
        m = self.match(ids)
        rest = len(ids) - m.length
        if not rest:
            return 0
        per_token = sum(k[0, :, 0].numel() * k.element_size() + v[0, :, 0].numel() * v.element_size()
                        for k, v in kv)
        if rest * per_token > self.budget:
            return 0
        leaf = Node(ids=list(ids[m.length:]), kv=_slice(kv, m.length, len(ids)), parent=m.node,
                    last_use=next(self._clock))
        self._attach(leaf)
        self._evict()
        return rest

    def flush(self) -> int:
        """Drop everything; returns how many tokens were cached. A held match keeps its own nodes alive."""
        dropped = self.tokens
        self.root.children = {}
        self.bytes = self.tokens = self.nodes = 0
        self.flushes += 1
        return dropped

    def info(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "bytes": self.bytes, "tokens": self.tokens, "nodes": self.nodes,
                "evicted_nodes": self.evicted_nodes, "evicted_tokens": self.evicted_tokens, "flushes": self.flushes}

    # ------------------------------------------------------------------------------------------ internals
    def _attach(self, node: Node) -> None:
        assert node.parent is not None
        node.parent.children[node.ids[0]] = node
        node.nbytes = _nbytes(node.kv)
        self.bytes += node.nbytes
        self.tokens += len(node.ids)
        self.nodes += 1

    def _detach(self, node: Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.ids[0]]
        self.bytes -= node.nbytes
        self.tokens -= len(node.ids)
        self.nodes -= 1

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper part (``node`` keeps the rest)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.ids)
        self._detach(node)
        upper = Node(ids=node.ids[:k], kv=_slice(node.kv, 0, k), parent=parent, last_use=node.last_use,
                     holders=node.holders)
        node.ids, node.kv, node.parent = node.ids[k:], _slice(node.kv, k), upper
        self._attach(upper)
        self._attach(node)
        return upper

    def _evict(self) -> None:
        """Evict unheld leaves, least recently used first, until the tree fits its budget."""
        if self.bytes <= self.budget:
            return
        order = itertools.count()  # ties: first found first (nodes themselves do not compare)
        heap = [(n.last_use, next(order), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.bytes > self.budget and heap:
            _, _, node = heapq.heappop(heap)
            self._detach(node)
            self.evicted_nodes += 1
            self.evicted_tokens += len(node.ids)
            parent = node.parent
            if parent is not self.root and parent is not None and not parent.children and not parent.holders:
                heapq.heappush(heap, (parent.last_use, next(order), parent))

    def _leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif not node.holders:
                out.append(node)
        return out
