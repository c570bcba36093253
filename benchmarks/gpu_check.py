#!/usr/bin/env python3
"""The learner's and the embedded engine's GPU paths, checked and measured in one run of a few minutes.

    python benchmarks/gpu_check.py --out /tmp/gpu-check           # on a CUDA machine (an H200 for the numbers)
    python benchmarks/gpu_check.py --out /tmp/gpu-check --quick   # the same parts at toy sizes (CPU dry run)

Parts, each in a child process with its own time limit (a hang or a crash in one still reports the others), all
under one ``--deadline-s``; everything printed is also written to ``--out`` (``summary.md`` and one log per part).
They run in the order flex, learner, long, engine, proxy: the correctness check first. On an H200 they take about
11 minutes in all, more than one call of a lent device may run: give each call a subset with ``--parts``.

1. ``learner``: ``benchmarks/learner.py`` — the issue-9 group (4 rollouts x 12 turns, 4k shared prompt, Qwen3-0.6B
   shape, random weights, bf16, flex attention) as one tree, per trajectory and per call: tokens, step time,
   ratios, MFU, peak memory.
2. ``flex``: flex-attention forward *and backward* on the packed tree against the path-expanded reference (every
   root-to-leaf path a causal sequence of its own), loss and every gradient, on random trees with retries and
   compaction segments (GRPO with KL and entropy, PPO with the value head, SFT) and on a multi-block tree. fp32
   must agree within the CPU tests' tolerance for the dense and chunked paths (1e-5 + 1e-4 |ref|); in bf16 (fp32 weights, bf16
   autocast: the learner's GPU default) both layouts are compared with the fp32 reference, and the tree's
   error must stay within twice the path-expanded layout's own bf16 error (floor 1e-3 relative): bf16 rounding
   is allowed, an error the tree layout adds is not.
3. ``long``: one group whose tree holds ~59k tokens (4 rollouts x 28 turns): step time and peak memory as a tree
   and per trajectory, as the learner runs it by default (activation checkpointing only for a micro-batch over
   ``micro_batch_tokens``: the tree, which goes alone) and with checkpointing everywhere (``--grad-ckpt``).
4. ``engine``: the embedded engine on CUDA (``[proxy.engine] device = "cuda"``), the Qwen3-0.6B shape with the
   full vocabulary in bf16: aggregate tokens/s at 1 and 16 concurrent requests; and the logprobs it returns for
   16 concurrent sampled requests (a left-padded batch) against a teacher-forced forward of the same weights,
   in fp32 (within 1e-3) and bf16 (judged against bf16's own teacher-forced error, as in part 2).
5. ``proxy``: ``benchmarks/proxy.py`` at 64 clients on this machine's cores (the many-core counterpart of the 2-core
   numbers in benchmarks/README.md): one proxy process tokenizing on its loop, the same tokenizing every call in
   worker threads (``--render-thread-chars 1``: where cores are spare, the loop keeps only the rest of a call), and
   1/2/4 proxy workers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

QWEN_VOCAB = 151936
PARTS = ("flex", "learner", "long", "engine", "proxy")
# Seconds each part may take at most (the deadline may cut it shorter).
LIMITS = {"flex": 100, "learner": 150, "long": 200, "engine": 180, "proxy": 75}


# ------------------------------------------------------------------------------------------------ driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.md and the parts' logs")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--deadline-s", type=float, default=560.0,
                    help="all parts together (their own limits add up to more: split a device run with --parts)")
    ap.add_argument("--quick", action="store_true", help="toy sizes: check the script itself (CPU is fine)")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # internal: run one part in this process
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        result = {"flex": part_flex, "engine": part_engine}[args.part](args)
        (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        return
    names = args.parts.split(",")
    if unknown := [n for n in names if n not in PARTS]:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    t_end = time.monotonic() + args.deadline_s
    quick = " (--quick: toy sizes, not measurements)" if args.quick else ""
    summary = [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{quick}", "", environment(), ""]
    failed = []
    for name in names:
        left = t_end - time.monotonic()
        if left < 15:
            summary += [f"## {name}", "", f"not run: the deadline (--deadline-s {args.deadline_s:.0f}) was reached", ""]
            failed.append(name)
            continue
        limit = min(LIMITS[name], left)
        print(f"\n===== {name} (limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        rc, text = run_part(name, args, limit)
        took = time.monotonic() - t0
        status = "ok" if rc == 0 else ("TIMED OUT" if rc is None else f"FAILED (exit {rc})")
        if rc != 0:
            failed.append(name)
        summary += [f"## {name}: {status}, {took:.0f} s", "", "```", text.rstrip()[-6000:], "```", ""]
        (args.out / "summary.md").write_text("\n".join(summary))
    (args.out / "summary.md").write_text("\n".join(summary))
    print(f"\nwrote {args.out / 'summary.md'}" + (f"; not ok: {', '.join(failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)


def environment() -> str:
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "missing"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"python {platform.python_version()}, torch {torch.__version__}, transformers {tf}, GPU: {gpu}, "
            f"{os.cpu_count()} CPUs")


def commands(name: str, args: argparse.Namespace) -> list[list[str]]:
    py, q = sys.executable, args.quick
    me = [py, str(Path(__file__).resolve()), "--out", str(args.out)] + (["--quick"] if q else [])
    learner = [py, str(HERE / "learner.py"), "--iters", "2"]
    if name == "learner":
        return [learner + (["--small", "--iters", "1"] if q else [])]
    if name == "long":
        long = learner + ["--turns", "28", "--layouts", "tree,trajectory"] + (["--small", "--iters", "1"] if q else [])
        # the learner's default (only micro-batches over the budget, here the tree, are checkpointed), then all
        return [long, long + ["--grad-ckpt"]]
    if name == "proxy":
        n = "300" if q else "1500"
        base = [py, str(HERE / "proxy.py"), "--levels", "64", "--requests", n, "--no-litellm"]
        rounds = ["--rounds", "1" if q else "3"]
        return [base + rounds, base + rounds + ["--render-thread-chars", "1"], base + ["--workers", "1,2,4"]]
    return [me + ["--part", name]]


def run_part(name: str, args: argparse.Namespace, limit: float) -> tuple[int | None, str]:
    """Run a part's commands in turn within ``limit`` seconds; (exit code or None on timeout, their output)."""
    end = time.monotonic() + limit
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    out: list[str] = []
    rc: int | None = 0
    with open(args.out / f"{name}.log", "w") as log:
        for cmd in commands(name, args):
            left = end - time.monotonic()
            line = "$ " + " ".join(Path(c).name if c == sys.executable else c for c in cmd[1:])
            print(line, flush=True)
            log.write(line + "\n")
            out.append(line)
            if left < 5:
                out.append("(skipped: the part's time is up)")
                rc = None
                break
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    cwd=REPO, start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                text, _ = proc.communicate()
                text += f"\n(killed after {left:.0f} s)"
                rc = None
            else:
                rc = proc.returncode if rc == 0 else rc
            print(text, flush=True)
            log.write(text)
            out.append(text)
            if rc is None:
                break
    return rc, "\n".join(out)


# ------------------------------------------------------------------------------------- part 2: flex numerics
def _learner(model, **kw):
    """A Learner on a fresh Accelerate state (each check has its own mixed precision)."""
    from accelerate.state import AcceleratorState

    from pipeline.training.learner import Learner
    from pipeline.training.stage import stage_settings

    AcceleratorState._reset_state(reset_partial_state=True)
    kw.setdefault("lr", 1e-3)
    return Learner(model, stage_settings(**kw))


def _loss_and_grads(model, groups, case: dict[str, Any], attention: str, bf16: bool) -> dict[str, Any]:
    import torch

    sft = case.get("sft", False)
    kw = {k: v for k, v in case.items() if k != "sft"}
    lrn = _learner(copy.deepcopy(model), attention=attention, micro_batch_tokens=1 if attention == "reference"
                   else 100_000, mixed_precision="bf16" if bf16 else "no", param_dtype="float32", **kw)
    if kw.get("advantage") == "ppo":  # a zero value head gives the trunk no value gradient; make it count
        w = torch.randn(lrn.net.value_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.3
        with torch.no_grad():
            lrn.net.value_head.weight.copy_(w)
    m = lrn.loss_and_grads(groups, sft=sft)
    grads = {n: (p.grad.detach().float().cpu() if p.grad is not None else torch.zeros(p.shape))
             for n, p in lrn.net.named_parameters()}
    return {"loss": float(m["loss"]), "targets": m["trainable_tokens"], "grads": grads}


def _abs_err(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """(largest |a - b| over the loss and every gradient element, and the same as a multiple of the CPU tests'
    tolerance 1e-5 + 1e-4 |b|: at most 1 passes)."""
    worst, ratio = abs(a["loss"] - b["loss"]), abs(a["loss"] - b["loss"]) / 1e-5
    for n, g in b["grads"].items():
        d = (a["grads"][n] - g).abs()
        worst = max(worst, float(d.max()))
        ratio = max(ratio, float((d / (1e-5 + 1e-4 * g.abs())).max()))
    return worst, ratio


def _rel_err(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative L2 error over the loss and the gradient tensors (tensors with a non-zero reference)."""
    errs = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12)]
    for n, g in b["grads"].items():
        if float(g.norm()) > 0:
            errs.append(float((a["grads"][n] - g).norm() / g.norm()))
    return max(errs)


def part_flex(args: argparse.Namespace) -> dict[str, Any]:
    import msgspec
    import numpy as np
    import torch

    from tests.helpers.learner_trees import group, random_paths, tiny_qwen3

    cuda = torch.cuda.is_available()
    attention = "flex" if cuda else "chunked"  # no flex backward on a CPU: the dry run checks the script
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both layouts
    torch.backends.cudnn.allow_tf32 = False
    cases = {
        "grpo+kl+entropy": {"advantage": "grpo", "kl_coef": 0.1, "entropy_coef": 0.01},
        "ppo": {"advantage": "ppo", "value_trunk_grad": True},
        "sft": {"sft": True},
    }
    trees: list[tuple[str, Any, list]] = []
    for seed in range(1 if args.quick else 2):
        rng = np.random.default_rng(seed)
        groups = []
        for g in range(2):
            n = int(rng.integers(2, 5))
            groups.append(group(random_paths(rng, n), list(rng.random(n).round(2)), gid=f"g{g}"))
        groups = [msgspec.structs.replace(g, temperature=t) for g, t in zip(groups, (0.8, 1.3), strict=True)]
        trees.append((f"random seed {seed}", tiny_qwen3(seed), groups))
    # Several flex blocks with real sparsity: the learner benchmark's tree at 1/8 (1/32 quick) of its lengths.
    from learner import Shape, layouts, make_model

    small, _ = make_model(small=True)
    shape = Shape(4, 12, 4096, 200, 300).scaled(32 if args.quick else 8)
    trees.append((f"benchmark tree / {32 if args.quick else 8}", small, [layouts(shape, 1024)["tree"]]))
    rows, ok = [], True
    print(f"tree layout: {attention}; reference: every root-to-leaf path as its own causal sequence (sdpa)")
    print(f"{'tree':<22} {'case':<16} {'targets':>7} {'fp32 abs':>9} {'x tol':>6} {'fp32 rel':>8} {'bf16 tree rel':>13}"
          f" {'bf16 ref rel':>12} {'verdict':>7}")
    for tree_name, model, groups in trees:
        for case_name, case in cases.items():
            if tree_name.startswith("benchmark") and case_name != "grpo+kl+entropy":
                continue
            ref32 = _loss_and_grads(model, groups, case, "reference", bf16=False)
            tree32 = _loss_and_grads(model, groups, case, attention, bf16=False)
            ref16 = _loss_and_grads(model, groups, case, "reference", bf16=True)
            tree16 = _loss_and_grads(model, groups, case, attention, bf16=True)
            a32, tol32 = _abs_err(tree32, ref32)
            r32 = _rel_err(tree32, ref32)  # the absolute check is weak where gradients are tiny
            r16, base16 = _rel_err(tree16, ref32), _rel_err(ref16, ref32)
            good = tol32 <= 1 and r32 <= 1e-4 and r16 <= max(2 * base16, 1e-3) and tree32["targets"] == ref32["targets"] > 0
            ok &= good
            rows.append({"tree": tree_name, "case": case_name, "targets": ref32["targets"], "fp32_abs": a32,
                         "fp32_tol_multiple": tol32, "fp32_rel": r32, "bf16_tree_rel": r16, "bf16_ref_rel": base16, "ok": good})
            print(f"{tree_name:<22} {case_name:<16} {int(ref32['targets']):>7} {a32:>9.1e} {tol32:>6.2f} {r32:>8.1e} {r16:>13.1e}"
                  f" {base16:>12.1e} {'ok' if good else 'FAIL':>7}", flush=True)
    print(f"\nfp32: |tree - reference| over the loss and every gradient element; x tol: the worst element as a "
          f"multiple of the CPU tests' tolerance 1e-5 + 1e-4 |reference| (<= 1 passes); fp32 rel: relative L2 error "
          f"(worst tensor, <= 1e-4 passes)\n"
          f"bf16: relative L2 error of each layout against the fp32 reference (worst tensor); the tree must stay "
          f"within 2x the reference layout's own (floor 1e-3)\n{'ALL OK' if ok else 'MISMATCH'}")
    if not ok:
        raise SystemExit(1)
    return {"attention": attention, "rows": rows}


# -------------------------------------------------------------------------------------- part 4: engine on CUDA
def _teacher_forced(model: Any, prompt: list[int], output: list[int], device: str) -> Any:
    """log softmax(logits) of each output token after the prompt and the output before it (T = 1), on the CPU."""
    import torch

    ids = torch.tensor([prompt + output], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output, device=device)[:, None])[:, 0].cpu()


def part_engine(args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    return anyio.run(_engine, args)


async def _engine(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import anyio
    import torch
    from engine import measure
    from learner import make_model
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from pipeline.models.small import IM_END, IM_START
    from pipeline.serving.engine import EngineSampling
    from pipeline.serving.launch import launch_embedded

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, cfg = make_model(small=args.quick or not cuda)
    if cfg.vocab_size < QWEN_VOCAB:  # the small model's toy vocabulary: the engine needs Qwen's ids
        cfg.vocab_size = QWEN_VOCAB
        model = Qwen3ForCausalLM(cfg)
    vocab = cfg.vocab_size
    res: dict[str, Any] = {"device": device, "vocab": vocab, "layers": cfg.num_hidden_layers}
    # --quick (a CPU dry run of the script, in CI): fewer and shorter requests, the same checks
    n, new = (8, 24) if args.quick else (16, 48)
    prompts = [[IM_START] + [(i * 131 + j * 7) % (vocab - 10) + 5 for j in range(20 + 23 * i)] + [IM_END]
               for i in range(n)]  # n different lengths: the batch is left-padded
    sampling = [EngineSampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=i) for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        engine_lp: dict[str, list[torch.Tensor]] = {}
        sampled: dict[str, list[list[int]]] = {}
        for dtype in ("bfloat16", "float32"):
            async with launch_embedded(tmp, device=device, dtype=dtype, max_running_requests=n, timeout_s=300,
                                       log_path=args.out / f"engine-{dtype}.log", threads=4) as client:
                info = await client.model_info()
                print(f"engine up: dtype {info['dtype']}, device {info['device']}, vocab {info['model_vocab_size']}",
                      flush=True)
                await measure(client, 2, 32, 8, 1)  # warm-up
                if dtype == "bfloat16":
                    print(f"{'concurrency':>11} {'agg tok/s':>10} {'x c=1':>6} {'s/request':>9} {'mean batch':>10}")
                    base = None
                    for c in (1, n):
                        before = await client.server_info()
                        tps, lat = await measure(client, c, 128 if args.quick else 512, 16 if args.quick else 128,
                                                 1 if args.quick else 2)
                        after = await client.server_info()
                        steps = after["decode_steps"] - before["decode_steps"]
                        occ = (after["decoded_tokens"] - before["decoded_tokens"]) / max(steps, 1)
                        base = base or tps
                        res[f"tok_s_c{c}"] = tps
                        print(f"{c:>11} {tps:>10.1f} {tps / base:>6.2f} {lat:>9.2f} {occ:>10.1f}", flush=True)
                outs: list[Any] = [None] * n

                async def one(i: int, client=client, outs=outs) -> None:
                    outs[i] = await client.generate(prompts[i], sampling[i], rid=f"tf-{i}")

                async with anyio.create_task_group() as tg:
                    for i in range(n):
                        tg.start_soon(one, i)
                res[f"max_batch_{dtype}"] = (await client.server_info())["max_batch"]
            engine_lp[dtype] = [torch.tensor(o.logprobs) for o in outs]
            # same seeds, other dtype: the tokens may differ, so each engine's own tokens are teacher-forced
            sampled[dtype] = [o.output_ids for o in outs]
        # Teacher forcing in this process, one sequence at a time, no cache, no padding; each model loaded once.
        # tf[(model dtype, engine dtype)]: the model's logprobs of that engine's tokens.
        tf: dict[tuple[str, str], list[torch.Tensor]] = {}
        for model_dtype, engines in (("bfloat16", ["bfloat16"]), ("float32", ["bfloat16", "float32"])):
            m = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, model_dtype)).to(device).eval()
            with torch.inference_mode():
                for engine_dtype in engines:
                    tf[(model_dtype, engine_dtype)] = [_teacher_forced(m, p, o, device)
                                                       for p, o in zip(prompts, sampled[engine_dtype], strict=True)]
            del m

        def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
            return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

        errs = {
            "engine_bfloat16_vs_tf_bfloat16": worst(engine_lp["bfloat16"], tf[("bfloat16", "bfloat16")]),
            "engine_bfloat16_vs_tf_float32": worst(engine_lp["bfloat16"], tf[("float32", "bfloat16")]),
            "tf_bfloat16_vs_tf_float32": worst(tf[("bfloat16", "bfloat16")], tf[("float32", "bfloat16")]),
            "engine_float32_vs_tf_float32": worst(engine_lp["float32"], tf[("float32", "float32")]),
        }
    res.update(errs)
    ok32 = errs["engine_float32_vs_tf_float32"] <= 1e-3
    ok16 = errs["engine_bfloat16_vs_tf_float32"] <= max(2 * errs["tf_bfloat16_vs_tf_float32"], 1e-2)
    print(f"\nlogprobs of {n} concurrent sampled requests ({new} tokens each, T=1, left-padded batch) against a "
          "teacher-forced forward of the same weights (max |difference| over all tokens):")
    for k, v in errs.items():
        print(f"  {k:<32} {v:.2e}")
    print(f"fp32 engine vs fp32 teacher forcing <= 1e-3: {'ok' if ok32 else 'FAIL'}\n"
          f"bf16 engine vs fp32 teacher forcing <= 2x bf16 teacher forcing's own error (floor 1e-2): "
          f"{'ok' if ok16 else 'FAIL'}")
    if not (ok32 and ok16):
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
