"""The embedded engine's prefix cache on its own, without a model: longest match, split edges, LRU eviction of
leaves within a byte budget, held nodes, flush, and that stored tensors are copies nobody else writes.

Each token's fake KV encodes the whole prefix up to it (as a real model's does), so a lookup that returned another
sequence's KV, or tokens in the wrong order, would not compare equal.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.serving.embedded.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 1, 2
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # float32 keys and values of every layer


def fake_kv(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[1, H, L, D] per layer; position p holds a number made from ids[: p + 1] and the layer."""
    codes = torch.tensor([float(hash(tuple(ids[: p + 1])) % 1_000_003) for p in range(len(ids))])
    out = []
    for layer in range(LAYERS):
        k = (codes + layer)[None, None, :, None].expand(1, HEADS, len(ids), DIM).clone()
        out.append((k, k + 0.5))
    return out


def assert_kv(cache: PrefixCache, ids: list[int], n: int) -> None:
    m = cache.match(ids)
    assert m.length == n, (m.length, n)
    got = cache.kv(m)
    if n == 0:
        assert got is None
        return
    want = fake_kv(ids[:n])
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want, strict=True))


def insert(cache: PrefixCache, ids: list[int]) -> int:
    return cache.insert(ids, fake_kv(ids))


def test_longest_match_splits_edges_and_counts_real_bytes():
    c = PrefixCache(1 << 20)
    assert insert(c, [1, 2, 3, 4]) == 4
    assert (c.nodes, c.tokens, c.bytes) == (1, 4, 4 * PER_TOKEN)
    assert insert(c, [1, 2, 5]) == 1  # splits [1 2 3 4] into [1 2] -> [3 4], and adds [5] under [1 2]
    assert (c.nodes, c.tokens, c.bytes) == (3, 5, 5 * PER_TOKEN)
    assert_kv(c, [1, 2, 5, 6], 3)
    assert_kv(c, [1, 2, 3, 4, 5], 4)
    assert_kv(c, [7, 1, 2], 0)
    assert c.nodes == 3
    # a lookup that ends inside an edge cuts it there; the bytes held do not change
    assert_kv(c, [1, 2, 3, 9], 3)
    assert (c.nodes, c.tokens, c.bytes) == (4, 5, 5 * PER_TOKEN)
    assert_kv(c, [1, 2, 3, 4], 4)
    assert insert(c, [1, 2, 3]) == 0  # a prefix of what is there: nothing new


def test_least_recently_used_leaf_is_evicted_first():
    c = PrefixCache(6 * PER_TOKEN)
    insert(c, [1, 2, 3])
    insert(c, [4, 5])
    c.match([1, 2, 3])  # A is used after B
    insert(c, [6, 7])  # 7 tokens > 6: B, the least recently used leaf, goes
    assert_kv(c, [4, 5], 0)
    assert_kv(c, [1, 2, 3], 3)
    assert_kv(c, [6, 7], 2)
    assert (c.evicted_nodes, c.evicted_tokens, c.tokens) == (1, 2, 5)


def test_only_leaves_are_evicted_and_a_parent_follows_its_last_child():
    c = PrefixCache(8 * PER_TOKEN)
    insert(c, [1, 2, 3, 4])
    insert(c, [1, 2, 5, 6])  # [1 2] -> {[3 4], [5 6]}
    insert(c, [9, 9, 9])  # 9 tokens: the oldest leaf [3 4] goes, the shared [1 2] stays
    assert_kv(c, [1, 2, 3, 4], 2)
    assert_kv(c, [1, 2, 5, 6], 4)
    assert (c.tokens, c.evicted_tokens) == (7, 2)
    insert(c, [8, 8])  # 9 tokens: [9 9 9] is older than [5 6], used just now
    assert_kv(c, [9, 9, 9], 0)
    insert(c, [7, 7, 7, 7, 7])  # 11 tokens: [5 6] goes, then its parent [1 2], a leaf now and older than [8 8]
    assert_kv(c, [1, 2], 0)
    assert_kv(c, [8, 8], 2)
    assert (c.tokens, c.bytes, c.evicted_nodes) == (7, 7 * PER_TOKEN, 4)


def test_held_nodes_are_not_evicted_until_released():
    c = PrefixCache(4 * PER_TOKEN)
    insert(c, [1, 2, 3])
    m = c.match([1, 2, 3])
    c.hold(m)
    insert(c, [4, 5])  # over budget, but the only other leaf is the new one
    assert_kv(c, [1, 2, 3], 3)
    assert_kv(c, [4, 5], 0)
    insert(c, [1, 2, 3, 6])  # a child of the held node
    assert_kv(c, [1, 2, 3, 6], 4)
    # a split of a held edge keeps both parts held
    insert(c, [1, 7])
    assert_kv(c, [1, 2, 3], 3)
    c.release(m)
    assert all(n.holders == 0 for n in (m.node, m.node.parent))
    insert(c, [8, 8, 8, 8])  # [7], then [2 3], then [1] (a leaf now): nothing is held any more
    assert_kv(c, [1, 2, 3], 0)
    assert c.bytes <= c.budget


def test_too_big_for_the_budget_is_not_stored_and_zero_means_off():
    c = PrefixCache(3 * PER_TOKEN)
    insert(c, [1, 2])
    assert insert(c, [5, 6, 7, 8]) == 0 and c.tokens == 2  # would evict everything and still not fit
    assert insert(c, [1, 2, 3]) == 1  # only the new token counts
    off = PrefixCache(0)
    assert insert(off, [1, 2]) == 0 and off.match([1, 2]).length == 0 and off.bytes == 0


def test_flush_empties_the_tree_and_a_held_match_survives_it():
    c = PrefixCache(1 << 20)
    insert(c, [1, 2, 3])
    insert(c, [1, 4])
    m = c.match([1, 2, 3])
    c.hold(m)
    assert c.flush() == 4
    assert (c.tokens, c.bytes, c.nodes, c.flushes) == (0, 0, 0, 1)
    assert_kv(c, [1, 2, 3], 0)
    # what a request being prefilled holds is still readable, and releasing it is harmless
    got = c.kv(m)
    assert got is not None and torch.equal(got[0][0], fake_kv([1, 2, 3])[0][0])
    c.release(m)
    assert c.info() == {"budget_bytes": 1 << 20, "bytes": 0, "tokens": 0, "nodes": 0, "evicted_nodes": 0,
                        "evicted_tokens": 0, "flushes": 1}


def test_stored_tensors_are_copies_of_their_own():
    c = PrefixCache(1 << 20)
    # a row of a left-padded batch cache: a view into a much larger tensor
    batch = [(torch.zeros(4, HEADS, 10, DIM), torch.zeros(4, HEADS, 10, DIM)) for _ in range(LAYERS)]
    ids = [1, 2, 3]
    for (k, v), (fk, fv) in zip(batch, fake_kv(ids), strict=True):
        k[2:3, :, 7:], v[2:3, :, 7:] = fk, fv
    row = [(k[2:3, :, 7:], v[2:3, :, 7:]) for k, v in batch]
    assert c.insert(ids, row) == 3
    assert c.bytes == 3 * PER_TOKEN  # the row's bytes, not the batch's
    for k, v in batch:  # the batch goes on being used
        k.fill_(-1.0)
        v.fill_(-1.0)
    assert_kv(c, ids, 3)
    got = c.kv(c.match(ids))
    assert got is not None
    got[0][0].fill_(-2.0)  # what a lookup returns is the caller's
    assert_kv(c, ids, 3)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=8)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from([0, 5, 12, 1 << 10]),
)
def test_against_a_list_of_cached_sequences(ops, budget_tokens):
    """Inserts and lookups in any order: a lookup finds the longest prefix any inserted sequence shares with it
    while nothing was evicted, never more, and always the right KV; the tree stays within its budget and its
    counters add up."""
    c = PrefixCache(budget_tokens * PER_TOKEN)
    seen: list[list[int]] = []
    for is_insert, ids in ops:
        best = max((_common(s, ids) for s in seen), default=0)
        if is_insert:
            c.insert(ids, fake_kv(ids))
            if budget_tokens and len(ids) - best <= budget_tokens:  # what alone exceeds the budget is not kept
                seen.append(ids)
        else:
            m = c.match(ids)
            assert m.length <= best
            if c.evicted_nodes == 0:
                assert m.length == best
            assert_kv(c, ids, m.length)
        assert c.bytes <= c.budget
        assert (c.nodes, c.tokens, c.bytes) == _walk(c)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _walk(c: PrefixCache) -> tuple[int, int, int]:
    nodes = tokens = nbytes = 0
    stack = list(c.root.children.values())
    while stack:
        n = stack.pop()
        assert n.ids and n.kv[0][0].shape[2] == len(n.ids)
        assert all(child.parent is n and key == child.ids[0] for key, child in n.children.items())
        nodes, tokens = nodes + 1, tokens + len(n.ids)
        nbytes += sum(t.untyped_storage().nbytes() for pair in n.kv for t in pair)
        stack.extend(n.children.values())
    return nodes, tokens, nbytes
