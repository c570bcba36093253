#!/usr/bin/env python3
"""Can a policy shape learn a black-box harness's demonstrations? An offline SFT probe, minutes instead of a run.

    python benchmarks/sft_probe.py --log RUN/events.msgpack [--hidden 128 --layers 2] [--tail 768] [--steps 240]
    python benchmarks/sft_probe.py --log RUN/events.msgpack --weights RUN2/weights/v00240   # measure a policy

It reads the cold-start demonstrations a run recorded through a harness (``collector.settled``, purpose ``sft``),
packs them as the tree builder does, trains a freshly built model of the given shape with the learner's own SFT
step, and every ``--eval-every`` steps measures on held-out demonstrations, teacher-forced:

- ``content``: accuracy of the tokens the answer copies from the instruction (file name, extension, word; a token
  counts by its text, so a copy inside a JSON string counts too): what the task is about; chance is the share of the
  most common choice;
- ``greedy``: the share of demonstrations whose every trained token is the model's argmax (what greedy decoding
  would write);
- ``p_exact``: the mean probability that sampling at temperature 1 writes the demonstration exactly.

``--tail N`` keeps only the last N prompt tokens of every call (the harness's system prompt and tool schemas cut
away): the same task with a short context, which tells a model that cannot learn the task from one that cannot find
the instruction in a long prompt. ``--window N`` gives the policy sliding-window attention over the whole prompt
instead (the learner's tree attention masks keys more than N positions back, as transformers does). Results and their reading: ``benchmarks/results/2026-12-06-blackbox-sft-probe.md``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from pipeline.core.eventlog import EventLogReader
from pipeline.core.logs import configure
from pipeline.messages import SettledRollout, TreeGroup, ids, pack_i32
from pipeline.models.small import VocabTable, create_small_model, load_vocab_table
from pipeline.tokens.render import qwen3_renderer
from pipeline.training.learner import Learner
from pipeline.training.stage import stage_settings
from pipeline.trees.packing import expand_paths, pack_demonstrations


def demonstrations(log: Path, tail: int) -> list[SettledRollout]:
    out = [ev.msg for ev in EventLogReader(log)
           if isinstance(ev.msg, SettledRollout) and ev.src == "collector.settled" and ev.msg.request.purpose == "sft"
           and (ev.msg.finished.reward or 0.0) >= 1.0]
    if not tail:
        return out

    def cut(r: SettledRollout) -> SettledRollout:
        k = max(0, len(ids(r.calls[0].input_ids)) - tail)  # every call shares the first call's prompt
        return msgspec.structs.replace(r, calls=[msgspec.structs.replace(c, input_ids=pack_i32(ids(c.input_ids)[k:]))
                                                 for c in r.calls])

    return [cut(r) for r in out]


def compact(g: TreeGroup, table: VocabTable) -> TreeGroup:
    return msgspec.structs.replace(g, packed=msgspec.structs.replace(
        g.packed, tokens=pack_i32(table.to_compact(ids(g.packed.tokens)))))


class HeldOut:
    """Teacher-forced measures over held-out demonstrations (module docstring)."""

    def __init__(self, group: TreeGroup, table: VocabTable) -> None:
        self.tokens = ids(group.packed.tokens)
        self.trainable = np.frombuffer(group.packed.trainable, np.uint8).astype(bool)
        self.paths = expand_paths(group.packed)
        tok = qwen3_renderer(enable_thinking=False).tokenizer
        self.create = int(table.to_compact(tok.encode("Create"))[0])
        # each compact id's text without its leading space or quote: a harness writes the copied name and word
        # as the instruction spells them (Codex's shell line: " b") or inside JSON strings (Claude Code's
        # "file_path": "b.txt": another token, "b"), and both count as the copy
        self.text = np.array([tok.decode([q]).strip().strip('"') for q in table.ids], dtype=object)
        self.text[0] = ""  # the UNK row
        self.boiler = {self.text[c] for c in table.to_compact(tok.encode(" containing:\n")).tolist()} | {""}

    def measure(self, policy: torch.nn.Module) -> dict[str, float]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(copy.deepcopy(policy.config), attn_implementation="sdpa")
        model.load_state_dict(policy.state_dict())
        model.eval()
        greedy, p_exact, content = [], [], []
        with torch.no_grad():
            for p in self.paths:
                seq = self.tokens[p]
                logp = torch.log_softmax(model(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0, :-1], -1)
                target, trained = seq[1:], self.trainable[p][1:]
                hit = logp.argmax(-1).numpy() == target
                greedy.append(bool(hit[trained].all()))
                p_exact.append(float(logp[torch.arange(len(target)), torch.tensor(target)].numpy()[trained].sum()))
                # the instruction's own tokens ("Create file NAME containing: WORD"), boilerplate left out
                at = np.flatnonzero(seq == self.create)
                said = {self.text[t] for t in seq[at[-1] + 2: at[-1] + 8]} - self.boiler if len(at) else set()
                copied = trained & np.isin(self.text[target], list(said))
                if copied.any():
                    content.append(float(hit[copied].mean()))
        return {"content": float(np.mean(content)) if content else float("nan"), "greedy": float(np.mean(greedy)),
                "p_exact": float(np.mean(np.exp(p_exact)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, required=True, help="a run's events.msgpack with demonstrations")
    ap.add_argument("--model-dir", type=Path, help="the run's model folder, for its vocabulary (default: [run].model)")
    ap.add_argument("--train", type=int, default=320, help="demonstrations trained on (the first ones)")
    ap.add_argument("--heldout", type=int, default=48, help="demonstrations measured on (the last ones)")
    ap.add_argument("--pack", type=int, default=64, help="demonstrations per tree, as [tree].sft_pack")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tail", type=int, default=0, help="keep only the last N prompt tokens (0: all)")
    ap.add_argument("--window", type=int, default=0, help="give every layer a sliding attention window of this many "
                    "tokens (0: full attention)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", type=Path, help="measure this policy folder (a run's weights/vNNNNN) instead of "
                    "training one; its vocabulary must be the run's")
    a = ap.parse_args()
    configure(level="warning")  # the tree builder's and learner's per-item lines would bury the table

    reader = EventLogReader(a.log)
    model_dir = a.model_dir or Path(reader.header.config["run"]["model"])
    table = load_vocab_table(model_dir)
    if table is None:
        raise SystemExit(f"{model_dir}: no reduced vocabulary (bridle_vocab.json); the probe builds reduced models")
    demos = demonstrations(a.log, a.tail)
    if len(demos) < a.train + a.heldout:
        raise SystemExit(f"{a.log}: {len(demos)} demonstrations scored 1; --train + --heldout needs "
                         f"{a.train + a.heldout}")
    packs = [compact(pack_demonstrations(demos[i:min(i + a.pack, a.train)], f"p{i}"), table)
             for i in range(0, a.train, a.pack)]  # never past --train: the held-out ones stay held out
    held = HeldOut(compact(pack_demonstrations(demos[-a.heldout:], "held"), table), table)
    if a.weights is not None:
        from transformers import AutoModelForCausalLM

        m = held.measure(AutoModelForCausalLM.from_pretrained(a.weights))
        print(f"{a.weights} on the last {a.heldout} demonstrations of {a.log}: content {m['content']:.3f}, greedy "
              f"{m['greedy']:.3f}, p_exact {m['p_exact']:.3f}")
        return
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        create_small_model(tmp, vocab=table, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                           num_kv_heads=a.kv_heads, max_position_embeddings=32768, seed=a.seed,
                           sliding_window=a.window)
        learner = Learner(tmp, stage_settings(lr=a.lr, micro_batch_tokens=1 << 16, seed=a.seed))
    rng = np.random.default_rng(a.seed)
    tokens = np.mean([len(ids(g.packed.tokens)) for g in packs])
    print(f"{len(demos)} demonstrations; {len(packs)} packs of {a.pack} ({tokens:.0f} tokens each); hidden "
          f"{a.hidden}, {a.layers} layers; tail {a.tail or 'all'}; window {a.window or 'none'}\n")
    print("| step | SFT loss | content | greedy | p_exact | minutes |\n| ---: | ---: | ---: | ---: | ---: | ---: |")
    t0 = time.monotonic()
    for step in range(1, a.steps + 1):
        loss = learner.sft_step([packs[int(rng.integers(len(packs)))]])["sft_loss"]
        if step % a.eval_every == 0 or step == a.steps:
            m = held.measure(learner._policy())
            print(f"| {step} | {loss:.3f} | {m['content']:.3f} | {m['greedy']:.3f} | {m['p_exact']:.3f} | "
                  f"{(time.monotonic() - t0) / 60:.1f} |", flush=True)


if __name__ == "__main__":
    main()
