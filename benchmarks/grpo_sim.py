#!/usr/bin/env python3
"""A fast stand-in for the quickstart's RL phase, for tuning its settings: minutes per run instead of ~12.

It reuses what a finished quickstart run recorded — the SFT demonstration packs and, per task, the exact first
prompt the white-box harness sent — and replaces only the slow outer loop: sampling happens in this process with
the Hugging Face model (KV cache, batch = one group), and the reward is computed from the first call's tool-call
arguments (what `create_word`'s verifier checks after the harness executes that call: the file at the asked path
holds the asked word). The groups then go through the real tree builder (`pipeline.trees.packing.build_group`) and the
real `Learner.train_step`, so advantages, loss aggregation, KL, clipping and the optimizer are the shipped code.
What it leaves out: the harness's later turns (the "Done." answer after the tool result), the sandbox, staleness.
It reproduced the pipeline's behaviour closely enough to choose the quickstart's settings (configs/quickstart.toml);
confirm any change with `benchmarks/quickstart_learning.py`.

    python benchmarks/grpo_sim.py --run runs/<a quickstart run> [--seeds 0 1 2] [--steps 30] [--groups 8]
        [--group-size 8] [--set lr=5e-4 --set kl_coef=0.05 ...]   # any [learner.train] field, by its flat name (stage_settings)
        [--pool 40]     # train on 40 of the run's RL tasks, one shuffled pass per epoch (as the quickstart does)
        [--eval 40]                                                # sampled-outcome breakdown before and after

SFT weights are computed once per (seed, SFT steps) and cached under the run folder (`grpo_sim/`).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import random
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline.core.eventlog import EventLogReader
from pipeline.core.logs import configure
from pipeline.messages import (
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SamplingParams,
    SettledRollout,
    TreeGroup,
    ids,
    pack_f32,
    pack_i32,
)
from pipeline.models.small import VocabTable, load_vocab_table
from pipeline.rollout.taskgen import generate
from pipeline.tokens.render import qwen3_renderer
from pipeline.training.learner import Learner
from pipeline.training.stage import stage_settings
from pipeline.trees.packing import build_group

ROOT = Path(__file__).resolve().parent.parent
IM_END = 151645


def compact(g: TreeGroup, vocab: VocabTable) -> TreeGroup:
    packed = msgspec.structs.replace(g.packed, tokens=pack_i32(vocab.to_compact(ids(g.packed.tokens))))
    return msgspec.structs.replace(g, packed=packed)


def load_run(run: Path) -> tuple[str, list[TreeGroup], dict[str, np.ndarray]]:
    """(model path, SFT packs, first prompt per RL task id) from a quickstart run folder."""
    cfg = tomllib.loads((run / "config.toml").read_text())
    model = cfg["learner"]["model"]
    model = str(ROOT / model) if not Path(model).is_absolute() else model
    sft: list[TreeGroup] = []
    first: dict[str, np.ndarray] = {}
    task_of: dict[str, str] = {}
    for ev in EventLogReader(run / "events.msgpack"):
        m = ev.msg
        if isinstance(m, TreeGroup) and m.purpose == "sft":
            sft.append(m)
        elif isinstance(m, RolloutRequest) and m.purpose == "train":  # the tasks RL trained on
            task_of[m.rollout_id] = m.task_id
        elif isinstance(m, ModelCall) and m.seq == 0 and m.rollout_id in task_of:
            first.setdefault(task_of[m.rollout_id], ids(m.input_ids))
    if not sft or not first:
        raise SystemExit(f"{run}: no SFT packs or no recorded calls; pass a finished quickstart run folder")
    return model, sft, first


def expected(task_id: str) -> tuple[str, str]:
    family, seed = task_id.rsplit("-", 1)
    acts = json.loads(generate(family, int(seed)).solution["actions.json"])
    return acts[0]["args"]["path"], acts[0]["args"]["content"]


@torch.no_grad()
def sample(model: Any, vocab: VocabTable, prompt: np.ndarray, n: int, max_new: int = 64) -> tuple[list, list]:
    """n samples at temperature 1 from one prompt: (Qwen output ids, logprobs) per sample."""
    from transformers import DynamicCache

    x = torch.tensor(vocab.to_compact(prompt), dtype=torch.long)[None].repeat(n, 1)
    cache = DynamicCache(config=model.config)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=x, use_cache=True, **{kw: cache})
    end = int(vocab.to_compact([IM_END])[0])
    toks: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new):
        lp = torch.log_softmax(out.logits[:, -1].float(), -1)
        nxt = torch.multinomial(lp.exp(), 1)[:, 0]
        for i in range(n):
            if not done[i]:
                toks[i].append(int(nxt[i]))
                lps[i].append(float(lp[i, nxt[i]]))
        done |= nxt == end
        if done.all():
            break
        out = model(input_ids=nxt[:, None], use_cache=True, **{kw: cache})
    return [vocab.to_qwen(t) for t in toks], lps


def outcome(renderer: Any, out: np.ndarray, want: tuple[str, str]) -> str:
    p = renderer.parse([int(t) for t in out])
    if not (p.tool_calls and isinstance(p.tool_calls[0].arguments, dict)):
        return "no tool call"
    a = p.tool_calls[0].arguments
    path, content = a.get("path"), str(a.get("content", "")).strip()
    if path == want[0] and content == want[1]:
        return "ok"
    if path == want[0]:
        return "wrong content"
    if isinstance(path, str) and path.split(".")[0] == want[0].split(".")[0]:
        return "wrong extension"
    return "wrong path"


def breakdown(learner: Learner, vocab: VocabTable, renderer: Any, prompts: dict, tasks: list[str]) -> str:
    model = learner._policy().eval()
    c: collections.Counter[str] = collections.Counter()
    for t in tasks:
        outs, _ = sample(model, vocab, prompts[t], 8)
        c.update(outcome(renderer, o, expected(t)) for o in outs)
    model.train()
    n = sum(c.values())
    return ", ".join(f"{k} {v / n:.2f}" for k, v in c.most_common())


def run_seed(args: argparse.Namespace, seed: int, model_path: str, sft: list[TreeGroup], prompts: dict) -> list[float]:
    torch.manual_seed(seed)
    vocab = load_vocab_table(model_path)
    if vocab is None:
        raise SystemExit(f"{model_path} has no reduced vocabulary table; grpo_sim is for the quickstart model")
    renderer = qwen3_renderer(enable_thinking=False)
    packs = [compact(g, vocab) for g in sft]
    sft_dir = args.run / "grpo_sim" / f"sft-seed{seed}-{args.sft_steps}"
    if not (sft_dir / "config.json").is_file():
        lrn = Learner(model_path, stage_settings(lr=args.sft_lr, micro_batch_tokens=2048, seed=seed))
        rng = random.Random(seed)
        order: list[TreeGroup] = []
        while len(order) < args.sft_steps:
            o = list(packs)
            rng.shuffle(o)
            order += o
        for g in order[: args.sft_steps]:
            lrn.sft_step([g])
        lrn.save_weights(sft_dir)
    overrides = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (s.split("=", 1) for s in args.sets)}
    cfg = stage_settings(**{"micro_batch_tokens": 2048, "seed": seed, **overrides})
    learner = Learner(str(sft_dir), cfg)
    tasks = sorted(prompts)
    held = tasks[: args.eval]
    if args.pool:
        # a fixed pool (the same for every seed), visited in a fresh shuffled order each epoch
        tasks = random.Random(1000).sample(tasks, args.pool)
    order: list[str] = []
    if args.eval:
        print(f"seed {seed} before RL: {breakdown(learner, vocab, renderer, prompts, held)}", flush=True)
    rng = random.Random(seed)
    rewards = []
    t0 = time.time()
    for step in range(args.steps):
        model = learner._policy().eval()
        groups, step_rewards = [], []
        for gi in range(args.groups):
            if args.pool:
                if not order:
                    order = rng.sample(tasks, len(tasks))
                task = order.pop()
            else:
                task = rng.choice(tasks)
            outs, lps = sample(model, vocab, prompts[task], args.group_size)
            want = expected(task)
            settled = []
            for k, (o, lp) in enumerate(zip(outs, lps, strict=True)):
                reward = float(outcome(renderer, o, want) == "ok")
                step_rewards.append(reward)
                rid, gid = f"s{step}g{gi}r{k}", f"s{step}g{gi}"
                req = RolloutRequest(rollout_id=rid, group_id=gid, index=k, group_size=args.group_size,
                                     task_id=task, harness="sim", token="-", policy_version=learner.version,
                                     sampling=SamplingParams())
                call = ModelCall(rollout_id=rid, call_id="c0", seq=0, protocol="chat",
                                 input_ids=pack_i32(prompts[task]), output_ids=pack_i32(o),
                                 logprobs=pack_f32(np.asarray(lp, dtype=np.float32)))
                fin = RolloutFinished(rollout_id=rid, group_id=gid, status="ok", reward=reward)
                settled.append(SettledRollout(request=req, finished=fin, calls=[call]))
            g = build_group(settled).message
            if isinstance(g, TreeGroup):
                groups.append(compact(g, vocab))
        model.train()
        m = learner.train_step(groups)
        rewards.append(float(np.mean(step_rewards)))
        print(f"seed {seed} step {step + 1:3d} reward {rewards[-1]:.3f} entropy {m['entropy']:.3f} "
              f"kl {m.get('kl', 0.0):.4f} grad_norm {m['grad_norm']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    if args.eval:
        print(f"seed {seed} after RL:  {breakdown(learner, vocab, renderer, prompts, held)}", flush=True)
    return rewards


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a finished quickstart run folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=160)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="StageSettings field=TOML value")
    ap.add_argument("--pool", type=int, default=0,
                    help="train on this many tasks, one shuffled pass per epoch (0: draw from all recorded tasks)")
    ap.add_argument("--eval", type=int, default=0, help="tasks in the before/after outcome breakdown (8 samples)")
    args = ap.parse_args()
    configure(level="warning")
    torch.set_num_threads(1)  # tiny matrices: more threads only contend
    model_path, sft, prompts = load_run(args.run)
    rows = []
    for seed in args.seeds:
        r = run_seed(args, seed, model_path, sft, prompts)
        first, last = statistics.mean(r[:5]), statistics.mean(r[-5:])
        rows.append((seed, first, last))
    print(f"{'seed':>4} {'first-5':>8} {'last-5':>8} {'gain':>7}   settings: {' '.join(args.sets) or 'defaults'}")
    for seed, first, last in rows:
        print(f"{seed:>4} {first:>8.3f} {last:>8.3f} {last - first:>+7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
