"""The embedded engine's batcher driven step by step in-process (no HTTP, no thread), and the teacher-forced
log-probabilities its answers are checked against. Used by the batcher and prefix-cache tests."""

from __future__ import annotations

import torch

from pipeline.serving.embedded.batcher import Add, Batcher, Req
from pipeline.serving.embedded.runner import ModelRunner


def make_req(rid: str, prompt: list[int], n: int, *, seed: int, sink: dict, temperature: float = 0.8) -> Req:
    """A request for ``n`` tokens (no stop) whose final answer lands in ``sink[rid]``."""

    def deliver(payload, final):
        if final:
            sink[rid] = payload

    return Req(rid=rid, prompt=prompt, max_new_tokens=n, temperature=temperature, top_p=1.0, top_k=-1,
               stop_ids=frozenset(), ignore_eos=True, return_logprob=True, stream=False,
               generator=torch.Generator().manual_seed(seed), deliver=deliver)


def drive(batcher: Batcher, arrivals: list[tuple[int, Req]], max_steps: int = 500) -> None:
    """Add each request at its step, as the decode thread would between two steps, until the engine is idle."""
    step = 0
    while step <= max((at for at, _ in arrivals), default=0) or batcher.rows or batcher.waiting:
        for at, r in arrivals:
            if at == step:
                batcher._command(Add(r))
        batcher._drop_finished()
        batcher._admit()
        if batcher.rows:
            batcher._step()
        batcher._drop_finished()
        step += 1
        assert step < max_steps
    assert all(r.finish is not None for _, r in arrivals)


def logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def teacher_forced(runner: ModelRunner, req: Req) -> torch.Tensor:
    """The log-probabilities of ``req``'s output under one forward of its whole sequence (greedy: unscaled)."""
    ids = torch.tensor(req.prompt + req.out_model)
    with torch.no_grad():
        logits = runner.model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits / req.temperature if req.temperature > 0 else logits, dim=-1)
    n = len(req.prompt)
    return lp[n - 1 : -1].gather(1, ids[n:, None])[:, 0]
