"""The quickstart's policy: a tiny Qwen3-architecture model with a reduced vocabulary, built on first use.

``vocabulary = "full"`` builds one with every Qwen id instead (``[experiment.build_model]``): slower per token on a
CPU, but it can show and produce anything a black-box harness sends, whose prompts (system prompts of thousands of
tokens, tool schemas, the model's own garbage fed back) no reduced table can cover.

The vocabulary table holds every Qwen id the quickstart can show the model or ask it to produce: the white-box
harness's system prompts and tool definitions, the chat template, and complete oracle episodes (instruction, tool
call, tool result, final answer) of many generated tasks, rendered exactly as the proxy renders them. Ids outside
the table map to the UNK slot (pipeline.models.small), so an unexpected id degrades gracefully instead of failing.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from harness_images.whitebox.agent import components as wb
from harness_images.whitebox.agent.observe import observe
from harness_images.whitebox.agent.tools import Tools
from pipeline.core.logs import get_logger
from pipeline.models.small import VocabTable, create_small_model
from pipeline.rollout.harness_space import HarnessConfig
from pipeline.rollout.taskgen import generate, resolve_families
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import qwen3_renderer

log = get_logger(part="quickstart")


class ModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: str = "runs/cache/quickstart-model-v3"
    harness: str = "whitebox:S0T0O0C0W0"
    families: str = "create_file"
    tasks: int = 400  # generated episodes the vocabulary is collected from
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0
    # reduced: only the ids the quickstart's episodes use (harness and families above); full: all Qwen ids.
    vocabulary: Literal["reduced", "full"] = "reduced"
    # > 0: the untrained policy ends a turn after about this many tokens (pipeline.models.small.end_turns_early);
    # a black-box harness then sees answers end instead of every one cut at the token cap.
    mean_reply_tokens: int = 0


def episode_conversations(spec: ModelSpec) -> list[Conversation]:
    """Oracle episodes as the white-box harness would send them (final call: the whole episode)."""
    cfg = HarnessConfig.parse(spec.harness.partition(":")[2] or "S0T0O0C0W0")
    tool_defs, to_canonical, _ = wb.tool_interface(cfg.t)
    offered = {v: k for k, v in to_canonical.items()}
    tools = [Tool(name=t["function"]["name"], description=t["function"]["description"],
                  parameters=t["function"]["parameters"]) for t in tool_defs]
    convs = []
    with tempfile.TemporaryDirectory() as ws:
        runner = Tools(Path(ws), Path(ws) / "corpus", 10.0, 4000)
        for fam in resolve_families(spec.families):
            for seed in range(spec.tasks):
                task = generate(fam, seed)
                actions = json.loads(task.solution.get("actions.json", "[]"))
                msgs = [Message(role="system", content=wb.SYSTEM_PROMPTS[cfg.s]),
                        Message(role="user", content=task.instruction)]
                for i, a in enumerate(actions):
                    name = offered[a["tool"]]
                    msgs.append(Message(role="assistant", tool_calls=[ToolCall(name=name, arguments=a["args"])]))
                    res = runner.run(a["tool"], dict(a["args"]))
                    msgs.append(Message(role="tool", content=observe(cfg.o, res, name, i + 1, 3)))
                msgs.append(Message(role="assistant", content="Done."))
                convs.append(Conversation(messages=msgs, tools=tools))
    return convs


def vocabulary(spec: ModelSpec) -> VocabTable:
    renderer = qwen3_renderer(enable_thinking=False)
    seqs: list[Any] = [renderer.render_ids(c, add_generation_prompt=True) for c in episode_conversations(spec)]
    # every system prompt and tool wording, so other S/T/O realizations stay inside the table
    for text in (*wb.SYSTEM_PROMPTS, json.dumps(wb.TOOLS_SPEC), wb.PLAN_REQUEST, wb.PLAN_ACK, wb.VERIFY_PROMPT,
                 wb.SUMMARY_PROMPT, wb.SUMMARY_PREFIX, wb.STATE_PROMPT, wb.STATE_PREFIX):
        seqs.append(renderer.tokenizer.encode(text))
    seqs.append(renderer.tokenizer.encode("".join(chr(c) for c in range(32, 127)) + "\n\t"))
    return VocabTable.from_sequences(seqs)


def ensure_model(spec: ModelSpec) -> Path:
    """Build the model at ``spec.path`` unless it is already there (idempotent)."""
    out = Path(spec.path)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    table = vocabulary(spec) if spec.vocabulary == "reduced" else None
    tmp = out.with_name(out.name + ".tmp")
    create_small_model(tmp, vocab=table, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                       num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                       max_position_embeddings=spec.max_position_embeddings, seed=spec.seed,
                       mean_reply_tokens=spec.mean_reply_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    log.info("quickstart model created", path=str(out), vocab=table.size if table else "full")
    return out
