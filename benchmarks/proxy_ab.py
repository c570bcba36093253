#!/usr/bin/env python3
"""A/B for a proxy change: the proxies of two source trees side by side, in interleaved rounds.

    git worktree add /tmp/before HEAD~1
    python benchmarks/proxy_ab.py --before /tmp/before              # this tree is "after"
    python benchmarks/proxy_ab.py --before /tmp/before --rounds 12 --requests 2000 --clients 64

Why: on a shared machine the CPU a process gets per request swings by ±15 % between minutes, so two runs of
``benchmarks/proxy.py`` cannot tell a 10 % change from noise. Here one zero engine serves both proxies (each
``benchmarks/proxy.py --serve-bridle`` of its own tree, its imports from that tree), and each round runs the same
closed-loop client (fresh ~2k-token prompts, streaming) against one, then the other, alternating which goes first.
Reported per round and as medians: the proxy's main-thread (event loop) CPU per request, from /proc, and
requests/s; the after/before ratio of loop CPU per round says whether a change holds up in every round. The offline
render time each round shows how the machine's speed moved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# benchmarks/ is sys.path[0] when run as a script
from _children import Child, main_thread_cpu_seconds
from _proxy_workload import build_prompt, offline_render_ms
from proxy import bench_folder, run_level, warmup_requests

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other source tree (a git worktree of the old commit)")
    ap.add_argument("--after", default=str(ROOT), help="default: this tree")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1200, help="timed requests per round and proxy")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, tree in trees.items():
        if not (tree / "benchmarks" / "proxy.py").is_file() or not (tree / "pipeline").is_dir():
            sys.exit(f"--{name} {tree}: not a bridle source tree (no benchmarks/proxy.py or pipeline/)")

    from pipeline.tokens.tokenizer import QwenTokenizer

    ids = QwenTokenizer().encode("OK<|im_end|>")
    prompt, n_prompt = build_prompt(args.prompt_tokens)
    with bench_folder("bridle-proxy-ab-", prompt) as (tmp, prompt_file, children):
        engine = Child("engine", [sys.executable, str(ROOT / "benchmarks" / "_zero_engine.py"), "--ids",
                                  *map(str, ids), "--text", "OK"], log_dir=tmp)
        children.append(engine)
        url = engine.wait_line("ENGINE-READY ", 60)
        proxies = {}
        for name, tree in trees.items():
            # PYTHONPATH first: an editable install of either tree would otherwise win the import of `pipeline`
            child = Child(name, [sys.executable, str(tree / "benchmarks" / "proxy.py"), "--serve-bridle", "0", url,
                                 "--rollouts", str(args.clients)], stdin=True, log_dir=tmp,
                          env={"PYTHONPATH": str(tree)})
            children.append(child)
            ready = json.loads(child.wait_line("BRIDLE-READY ", 120))
            tokens = tmp / f"{name}-tokens.json"
            tokens.write_text(json.dumps(ready["tokens"]))
            proxies[name] = (ready, tokens)
        print(f"prompt {n_prompt} tokens, {args.clients} clients, {args.requests} requests per round and proxy; "
              f"before = {trees['before']}, after = {trees['after']}", flush=True)
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for rnd in range(args.rounds):
            order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
            for name in order:
                ready, tokens = proxies[name]
                cpu0 = main_thread_cpu_seconds(ready["pid"])
                r = run_level(ready["base_url"] + "/v1/chat/completions", str(tokens), prompt_file, args.clients,
                              args.requests, f"{name}-{rnd}", 16, 1)
                if r["errors"]:
                    sys.exit(f"{name}: {r['errors']} failed requests, e.g. {r['first_errors'][:2]}")
                served = len(r["latencies"]) + warmup_requests(args.clients, 1)
                loop_ms = (main_thread_cpu_seconds(ready["pid"]) - cpu0) / served * 1e3
                rows[name].append((loop_ms, len(r["latencies"]) / r["wall"]))
            b, a = rows["before"][-1], rows["after"][-1]
            print(f"round {rnd}: before {b[0]:.3f} ms/req {b[1]:.0f} req/s | after {a[0]:.3f} ms/req {a[1]:.0f} req/s"
                  f" | after/before loop {a[0] / b[0]:.3f} | offline render {offline_render_ms(prompt):.3f} ms",
                  flush=True)
    ratios = [a[0] / b[0] for a, b in zip(rows["after"], rows["before"], strict=True)]
    print()
    print("proxy    median loop CPU ms/request    median req/s")
    for name in trees:
        print(f"{name:7s}  {statistics.median(x[0] for x in rows[name]):28.3f}    "
              f"{statistics.median(x[1] for x in rows[name]):12.0f}")
    print(f"after/before loop CPU: median {statistics.median(ratios):.3f}, rounds below 1: "
          f"{sum(x < 1 for x in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    main()
