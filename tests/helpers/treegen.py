"""Random SettledRollouts with a known structure, for tree/packing property tests and the benchmark.

A small simulated harness plays one rollout: a main conversation whose turns may be retried (a dead sibling), or
aborted and retried, whose outputs the harness may truncate when it sends them back, which may go back to an
earlier turn (a call extending a node that is not the latest), spawn subagents (their own chains) or compact its
context (a compaction call, then a new segment whose input carries the summary). Records may be duplicated and
arrive out of order. Every call remembers where each piece of its input came from, so a test can compute the
exact root-to-leaf sequences the tree must keep (:meth:`GenRollout.expected_paths`).

Token ids: environment messages start with a token in ``ENV_MARKS``, outputs with one in ``OUT_MARKS`` and the
special prompts with their own marks, so structure never depends on an accidental token match at a message
boundary; inside messages a small vocabulary makes shared prefixes and identical retries common.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from pipeline.messages import (
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    pack_f32,
    pack_i32,
)

ENV_MARKS = (1000, 1001, 1002)
OUT_MARKS = (2000, 2001)
SYS, SUB_SYS, COMPACT_REQ, SUMMARY, SUB_TASK = 3000, 3001, 3002, 3003, 4000


@dataclass(frozen=True)
class Spec:
    turns: int = 4  # main-agent turns (calls that are continued), over all segments
    vocab: int = 4
    msg_len: tuple[int, int] = (1, 6)  # environment message length range (inclusive)
    out_len: tuple[int, int] = (1, 6)
    p_retry: float = 0.0  # a turn is sampled twice; the first sample is abandoned (dead leaf)
    p_abort: float = 0.0  # a turn's first attempt is aborted (a failed record), then retried
    p_truncate: float = 0.0  # the harness sends back only a prefix of the output
    p_fork: float = 0.0  # the next turn goes back to the state after one of the two previous turns
    p_subagent: float = 0.0
    p_compaction: float = 0.0
    p_labelled: float = 1.0  # the proxy labels subagent / compaction calls (else it says "main")
    p_duplicate: float = 0.0  # a record arrives twice
    shuffle: bool = False


@dataclass
class GenCall:
    call_id: str
    seq: int
    label: str  # the truth
    proxy_label: str
    chain: int
    pieces: list[tuple[np.ndarray, int]]  # input pieces: (tokens, source call or -1 for environment)
    y: np.ndarray
    lp: np.ndarray
    parent: int  # the call whose output is the last output piece of the input, -1 if none
    extends: int  # parent, when that piece is its whole output
    n_calls: int
    aborted: bool = False

    @property
    def x(self) -> np.ndarray:
        return np.concatenate([p for p, _ in self.pieces]).astype(np.int32)


@dataclass
class GenRollout:
    settled: SettledRollout
    calls: list[GenCall] = field(default_factory=list)

    @property
    def live(self) -> list[GenCall]:
        return [c for c in self.calls if not c.aborted]

    def expected_paths(self, include_aux: bool = False) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(tokens, trainable, logprobs) of each kept root-to-leaf path: per chain, among calls that are trained
        and not extended by a trained call, the one with the most calls on its path (ties: the later call)."""
        calls = self.live
        idx = {c.seq: k for k, c in enumerate(calls)}
        included = [c.label == "main" or include_aux for c in calls]
        extended = {c.extends for k, c in enumerate(calls) if c.extends >= 0 and included[k]}
        best: dict[int, int] = {}
        for k, c in enumerate(calls):
            if not included[k] or c.seq in extended:
                continue
            if c.chain not in best or (c.n_calls, c.seq) > (
                calls[best[c.chain]].n_calls,
                calls[best[c.chain]].seq,
            ):
                best[c.chain] = k
        out = []
        for k in sorted(best.values()):
            c = calls[k]
            toks, train, lps = [], [], []
            for piece, src in c.pieces:
                toks.append(piece)
                on = src >= 0 and included[idx[src]]
                train.append(np.full(piece.shape[0], on))
                lps.append(
                    calls[idx[src]].lp[: piece.shape[0]] if on else np.zeros(piece.shape[0], np.float32)
                )
            toks.append(c.y)
            train.append(np.ones(c.y.shape[0], bool))
            lps.append(c.lp)
            out.append((np.concatenate(toks).astype(np.int32), np.concatenate(train), np.concatenate(lps)))
        return out


def _logprobs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A made-up log-probability per output token that depends only on the tokens up to it, as a real policy's
    would: identical samples in identical contexts (indistinguishable in the tree) get identical values."""
    h = zlib.crc32(x.astype(np.int32).tobytes())
    out = np.empty(y.shape[0], dtype=np.float32)
    for k, t in enumerate(y.astype(np.int32)):
        h = zlib.crc32(t.tobytes(), h)
        out[k] = -(h % 10007) / 10007 - 1e-3
    return out


def generate(
    rng: np.random.Generator,
    spec: Spec,
    *,
    prompt: np.ndarray,
    rollout_id: str = "r0",
    index: int = 0,
    group_id: str = "g0",
    group_size: int = 1,
    status: str = "ok",
    reward: float = 0.0,
) -> GenRollout:
    """Play one rollout; ``prompt`` (the shared system + task tokens) starts the main agent's first input."""
    player = _Player(rng, spec, rollout_id)
    player.play(prompt)
    settled = SettledRollout(
        request=RolloutRequest(
            rollout_id=rollout_id,
            group_id=group_id,
            index=index,
            group_size=group_size,
            task_id="t0",
            harness="gen",
            token="x",
            policy_version=0,
        ),
        finished=RolloutFinished(rollout_id=rollout_id, group_id=group_id, status=status, reward=reward),  # type: ignore[arg-type]
        calls=player.records(),
    )
    return GenRollout(settled, player.calls)


class _Player:
    """The simulated harness of one rollout: the calls it made, each drawn from ``rng`` in play order (so a seed
    replays the same rollout)."""

    def __init__(self, rng: np.random.Generator, spec: Spec, rollout_id: str) -> None:
        self.rng = rng
        self.spec = spec
        self.rollout_id = rollout_id
        self.calls: list[GenCall] = []
        self.n_chains = 0

    def msg(self, mark: int, lo_hi: tuple[int, int]) -> np.ndarray:
        n = int(self.rng.integers(lo_hi[0], lo_hi[1] + 1))
        return np.concatenate([[mark], self.rng.integers(0, self.spec.vocab, n - 1)]).astype(np.int32)

    def env_msg(self) -> np.ndarray:
        return self.msg(int(self.rng.choice(ENV_MARKS)), self.spec.msg_len)

    def call(
        self, pieces: list[tuple[np.ndarray, int]], label: str, chain: int, min_out: int = 1, aborted: bool = False
    ) -> GenCall:
        spec, calls = self.spec, self.calls
        lo = max(spec.out_len[0], min_out)
        y = self.msg(int(self.rng.choice(OUT_MARKS)), (lo, max(lo, spec.out_len[1])))
        last = next((src for _, src in reversed(pieces) if src >= 0), -1)
        full = last >= 0 and next(p for p, s in reversed(pieces) if s >= 0).shape[0] == calls[last].y.shape[0]
        proxy = label if label == "main" or self.rng.random() < spec.p_labelled else "main"
        c = GenCall(
            call_id=f"{self.rollout_id}-c{len(calls)}",
            seq=len(calls),
            label=label,
            proxy_label=proxy,
            chain=chain,
            pieces=list(pieces),
            y=y,
            lp=_logprobs(np.concatenate([p for p, _ in pieces]), y),
            parent=last,
            extends=last if full else -1,
            n_calls=(calls[last].n_calls + 1) if last >= 0 else 1,
            aborted=aborted,
        )
        calls.append(c)
        return c

    def new_chain(self) -> int:
        self.n_chains += 1
        return self.n_chains - 1

    def play(self, prompt: np.ndarray) -> None:
        """The main agent's turns, with the retries, aborts, truncations, forks, subagents and compactions
        ``spec`` draws."""
        spec, rng = self.spec, self.rng
        chain = self.new_chain()
        hist: list[tuple[np.ndarray, int]] = [(prompt, -1)]
        snapshots: list[list[tuple[np.ndarray, int]]] = []
        for turn in range(spec.turns):
            if turn > 0:
                hist.append((self.env_msg(), -1))
            if rng.random() < spec.p_abort:
                self.call(hist, "main", chain, aborted=True)
            if rng.random() < spec.p_retry:
                self.call(hist, "main", chain)
            live = self.call(hist, "main", chain)
            y = live.y
            if y.shape[0] >= 2 and rng.random() < spec.p_truncate:
                y = y[: int(rng.integers(1, y.shape[0]))]
            hist.append((y, live.seq))
            snapshots.append(list(hist))
            if turn == spec.turns - 1:
                break
            if rng.random() < spec.p_subagent:
                self.subagent()
            if len(snapshots) >= 2 and rng.random() < spec.p_fork:
                hist = list(snapshots[-2])
            if rng.random() < spec.p_compaction:
                req = self.msg(COMPACT_REQ, spec.msg_len)
                comp = self.call([*hist, (req, -1)], "compaction", chain, min_out=8)
                chain = self.new_chain()
                hist = [(prompt, -1), (np.concatenate([[SUMMARY], comp.y]).astype(np.int32), -1)]
                snapshots = []

    def subagent(self) -> None:
        """A subagent of one or two turns, on a chain of its own."""
        sub = self.new_chain()
        # Each subagent gets its own task (an identical one would be indistinguishable from a retry).
        task = np.concatenate([[SUB_SYS, SUB_TASK + sub], self.msg(SUB_SYS, (1, 6))[1:]]).astype(np.int32)
        s_hist: list[tuple[np.ndarray, int]] = [(task, -1)]
        for k in range(int(self.rng.integers(1, 3))):
            if k:
                s_hist.append((self.env_msg(), -1))
            sc = self.call(s_hist, "subagent", sub)
            s_hist.append((sc.y, sc.seq))

    def records(self) -> list[ModelCall]:
        """The calls as the proxy records them, some duplicated and (``spec.shuffle``) out of order."""
        spec, rng = self.spec, self.rng
        records = [
            ModelCall(
                rollout_id=self.rollout_id,
                call_id=c.call_id,
                seq=c.seq,
                protocol="chat",
                label=c.proxy_label,  # type: ignore[arg-type]
                input_ids=pack_i32(c.x),
                output_ids=pack_i32(c.y),
                logprobs=pack_f32(c.lp),
                finish_reason="abort" if c.aborted else "stop",
            )
            for c in self.calls
        ]
        records += [records[int(k)] for k in np.flatnonzero(rng.random(len(records)) < spec.p_duplicate)]
        if spec.shuffle:
            records = [records[int(k)] for k in rng.permutation(len(records))]
        return records


def generate_group(
    rng: np.random.Generator, spec: Spec, size: int, *, failed: tuple[int, ...] = (), prompt_len: int = 8
) -> list[GenRollout]:
    prompt = np.concatenate([[SYS], rng.integers(0, spec.vocab, prompt_len - 1)]).astype(np.int32)
    return [
        generate(
            rng,
            spec,
            prompt=prompt,
            rollout_id=f"r{k}",
            index=k,
            group_size=size,
            status="timeout" if k in failed else "ok",
            reward=float(rng.random()),
        )
        for k in range(size)
    ]


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    p = st.sampled_from([0.0, 0.3, 0.7])
    return Spec(
        turns=draw(st.integers(1, 6)),
        vocab=draw(st.sampled_from([2, 4, 50])),
        p_retry=draw(p),
        p_abort=draw(p),
        p_truncate=draw(p),
        p_fork=draw(p),
        p_subagent=draw(p),
        p_compaction=draw(p),
        p_labelled=draw(st.sampled_from([0.0, 0.5, 1.0])),
        p_duplicate=draw(p),
        shuffle=draw(st.booleans()),
    )


@dataclass(frozen=True)
class GroupCase:
    """A drawn group, small to print; :meth:`rollouts` plays it."""

    spec: Spec
    size: int
    failed: tuple[int, ...]
    seed: int

    def rollouts(self) -> list[GenRollout]:
        return generate_group(np.random.default_rng(self.seed), self.spec, self.size, failed=self.failed)


@st.composite
def groups(draw: st.DrawFn) -> GroupCase:
    """A whole group (1-4 rollouts, some possibly failed) of random rollouts."""
    spec = draw(specs())
    size = draw(st.integers(1, 4))
    failed = tuple(k for k in range(size) if draw(st.booleans()) and draw(st.booleans()))
    return GroupCase(spec, size, failed, draw(st.integers(0, 2**32 - 1)))


# Hand-written cases: one call / one settled rollout from explicit ids.
def mc(seq, x, y, label="main", call_id=None, finish="stop", lp=None, versions=()):
    lp = [-(seq + 1) / 10 - k / 100 for k in range(len(y))] if lp is None else lp
    return ModelCall(
        rollout_id="r0",
        call_id=call_id or f"c{seq}",
        seq=seq,
        protocol="chat",
        label=label,
        input_ids=pack_i32(x),
        output_ids=pack_i32(y),
        logprobs=pack_f32(lp),
        finish_reason=finish,
        versions=list(versions),
    )


def settled(calls, status="ok", rid="r0", index=0, group_size=2, reward=0.0, version=0):
    return SettledRollout(
        request=RolloutRequest(
            rollout_id=rid,
            group_id="g0",
            index=index,
            group_size=group_size,
            task_id="t0",
            harness="h",
            token="tok",
            policy_version=version,
        ),
        finished=RolloutFinished(rollout_id=rid, group_id="g0", status=status, reward=reward),
        calls=calls,
    )
