#!/usr/bin/env python3
"""Render + splice cost per call as an agent conversation grows (pipeline/splice.py, pipeline/render.py).

One rollout of 100 turns grows to about 64k tokens: each turn the model "samples" a thinking block, some text and
a tool call (tokenized from text), the harness sends it back re-serialized (JSON keys re-ordered, thinking kept)
with a ~2.3 KB tool result, and the next request is rendered through the Splicer. The cost of a call should be
proportional to its new tokens, not to the conversation: the last column compares µs per new token of the last
10 turns with the first 10 (goal: about 1). The "whole" column is the cost of re-rendering and re-tokenizing the
whole conversation without the prefix cache, for comparison.

    python benchmarks/tokens.py            # Qwen3 renderer (offline tokenizer)
    python benchmarks/tokens.py --hf       # also the HF-template path over bridle's Qwen tokenizer folder
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import HFTemplateRenderer, Renderer, qwen3_renderer
from pipeline.tokens.splice import Splicer

TURNS = 100
WORDS = [
    "def",
    "return",
    "import",
    "class",
    "self",
    "value",
    "result",
    "error",
    "file",
    "path",
    "line",
    "test",
    "assert",
    "None",
    "True",
    "for",
    "in",
    "if",
]


def tool_result(rng: random.Random, chars: int) -> str:
    lines, size = [], 0
    while size < chars:
        line = "    " * rng.randint(0, 3) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def run(
    renderer: Renderer, label: str, turns: int, result_chars: int, seed: int
) -> list[tuple[int, int, float, float]]:
    rng = random.Random(seed)
    tools = [
        Tool(
            name="bash",
            description="Run a shell command.",
            parameters={"type": "object", "properties": {"command": {"type": "string"}}},
        ),
        Tool(
            name="edit",
            description="Edit a file.",
            parameters={
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
            },
        ),
    ]
    msgs = [
        Message(role="system", content="You are a coding agent."),
        Message(role="user", content="Fix the failing tests."),
    ]
    splicer = Splicer(renderer)
    rows = []
    for i in range(turns):
        conv = Conversation(tools=tools, messages=list(msgs))
        t0 = time.perf_counter()
        res = splicer.render(conv)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        renderer.render_ids(conv, causal=True)
        whole = time.perf_counter() - t1
        rows.append((len(res.ids), res.new_tokens, dt, whole))
        args = {"path": f"src/mod_{i}.py", "old": tool_result(rng, 120), "new": tool_result(rng, 120)}
        out_text = (
            f"<think>\nStep {i}: "
            + tool_result(rng, 300)
            + "\n</think>\n\nEditing the file.\n"
            + '<tool_call>\n{"name": "edit", "arguments": '
            + json.dumps(args)
            + "}\n</tool_call><|im_end|>"
        )
        out = renderer.tokenizer.encode_np(out_text)
        parsed = renderer.parse(out)
        splicer.record(parsed, out)
        call = parsed.tool_calls[0]
        back = ToolCall(
            id=f"call_{i}", name=call.name, arguments=dict(reversed(list(call.arguments.items())))
        )
        msgs.append(
            Message(role="assistant", content=parsed.text, thinking=parsed.thinking, tool_calls=[back])
        )
        msgs.append(Message(role="tool", tool_call_id=back.id, content=tool_result(rng, result_chars)))
    print(f"\n{label}: {turns} turns, final prompt {rows[-1][0]} tokens")
    print(
        f"{'turn':>5} {'prompt tok':>10} {'new tok':>8} {'splice ms':>10} {'new tok/s':>11} {'µs/new tok':>11} {'whole ms':>9}"
    )
    for i in list(range(0, turns, 10)) + [turns - 1]:
        total, new, dt, whole = rows[i]
        print(
            f"{i:>5} {total:>10} {new:>8} {dt * 1e3:>10.2f} {new / dt:>11.0f} {dt / new * 1e6:>11.2f} {whole * 1e3:>9.2f}"
        )
    # medians: one garbage-collector pause should not decide the ratio; turn 0 renders the system prompt: skip it
    per = [dt / new for _, new, dt, _ in rows]
    head, tail = float(np.median(per[1:11])), float(np.median(per[-10:]))
    wper = [w / new for _, new, _, w in rows]
    whead, wtail = float(np.median(wper[1:11])), float(np.median(wper[-10:]))
    print(
        f"median µs per new token: first 10 turns {head * 1e6:.2f}, last 10 turns {tail * 1e6:.2f}, "
        f"ratio last-10/first-10 = {tail / head:.2f}  (whole re-render without the cache: {wtail / whead:.2f})"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument(
        "--result-chars",
        type=int,
        default=2300,
        help="tool result size; 2300 reaches ~64k tokens at 100 turns",
    )
    ap.add_argument("--hf", action="store_true", help="also benchmark the HF-template path")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    run(
        qwen3_renderer(), "Qwen3Renderer (Python ChatML + offline tokenizer)", a.turns, a.result_chars, a.seed
    )
    if a.hf:
        from pipeline.tokens.tokenizer import HFTokenizer, qwen_hf_folder

        run(
            HFTemplateRenderer(HFTokenizer(qwen_hf_folder())),
            "HFTemplateRenderer (jinja + HF tokenizer)",
            a.turns,
            a.result_chars,
            a.seed,
        )


if __name__ == "__main__":
    main()
