"""Tiny CPU policies built on first use (``[experiment.build_model]``): a Qwen3-architecture model with a reduced
vocabulary (the quickstart's, and the black-box learning experiment's), or with all Qwen ids.

A reduced table holds every Qwen id the model must *produce* and the ids of what it must *read* to do so; every
other id it is shown maps to the UNK slot (pipeline.models.small), so an unexpected id degrades gracefully instead
of failing, and the LM head stays small enough for a CPU:

- the white-box harness (``harness = "whitebox:…"``): its system prompts and tool definitions, the chat template,
  and complete oracle episodes (instruction, tool call, tool result, final answer) of many generated tasks,
  rendered exactly as the proxy renders them;
- a black-box harness (``"claude-code"``, ``"codex"``, ``"qwen-code"``, ``"openclaw"``): the oracle's answers as
  that harness's tool calls (its own tool names and argument forms, the ones its demonstrations play) rendered as
  the model writes them, and the task instructions. Its system prompt, tool schemas and tool results (thousands of
  tokens per call) are read as UNK positions: the model learns to act on the instruction, not on the harness's
  prose, which a model this small could not use anyway. ``harness`` may list several harnesses: one table then
  serves them all (a policy trained through one can be evaluated through another).

``vocabulary = "full"`` builds a model with every Qwen id instead: it can produce anything, at ~10x the cost per
token on a CPU (the 151,936-row head).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from harness_images.whitebox.agent import components as wb
from harness_images.whitebox.agent.observe import observe
from harness_images.whitebox.agent.tools import Tools
from pipeline.core.config import model_folder_problem
from pipeline.core.logs import get_logger
from pipeline.models.small import VocabTable, create_small_model
from pipeline.rollout import demonstrations
from pipeline.rollout.harness_space import HarnessConfig
from pipeline.rollout.harnesses import harness_for
from pipeline.rollout.taskgen import generate, resolve_families
from pipeline.rollout.tasks import TaskSpec
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import Renderer, qwen3_renderer

log = get_logger(part="quickstart")


class ModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: str = "runs/cache/quickstart-model-v3"
    # whose episodes the reduced vocabulary covers: one harness, or a list (module docstring)
    harness: str | list[str] = "whitebox:S0T0O0C0W0"
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
    # > 0: every layer attends only this many positions back (what lets a tiny policy find the instruction at the
    # end of a harness's 8-19k-token prompt: configs/blackbox.toml)
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window = {self.sliding_window}: 0 (full attention) or a window in tokens")


def _harnesses(spec: ModelSpec) -> list[str]:
    return [spec.harness] if isinstance(spec.harness, str) else list(spec.harness)


def episode_conversations(spec: ModelSpec, harness: str = "whitebox:S0T0O0C0W0") -> list[Conversation]:
    """Oracle episodes as the white-box harness would send them (final call: the whole episode)."""
    cfg = HarnessConfig.parse(harness.partition(":")[2] or "S0T0O0C0W0")
    tool_defs, to_canonical, _ = wb.tool_interface(cfg.t)
    offered = {v: k for k, v in to_canonical.items()}
    tools = [Tool(name=t["function"]["name"], description=t["function"]["description"],
                  parameters=t["function"]["parameters"]) for t in tool_defs]
    convs = []
    with tempfile.TemporaryDirectory() as ws:
        runner = Tools(Path(ws), Path(ws) / "corpus", 10.0, 4000)
        for task in _tasks(spec):
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


def _tasks(spec: ModelSpec) -> list[TaskSpec]:
    return [generate(fam, seed) for fam in resolve_families(spec.families) for seed in range(spec.tasks)]


def blackbox_sequences(spec: ModelSpec, harness: str, renderer: Renderer) -> list[list[int]]:
    """What a model must read and write to solve ``spec``'s tasks through black-box ``harness``: each task's
    instruction, and each of its oracle answers (the harness's own tool calls, then the final text) as the
    scripted engine plays them, which is how the model itself writes them."""
    adapter, variant = harness_for(harness)
    if adapter.demo_tools is None:
        raise ValueError(f"[experiment.build_model].harness {harness!r}: this harness has no demonstration tools, so "
                         "the vocabulary its answers need is unknown; use vocabulary = \"full\"")
    tools = adapter.demo_tools(variant)
    seqs: list[list[int]] = []
    for task in _tasks(spec):
        # the instruction as it appears inside the harness's message: alone, after a newline, after a space
        seqs += [renderer.tokenizer.encode(sep + task.instruction) for sep in ("", "\n", " ")]
        actions = [(a["tool"], a["args"]) for a in json.loads(task.solution.get("actions.json", "[]"))]
        for r in demonstrations.script(tools, actions):
            msg = Message(role="assistant", content=r.get("text", ""),
                          tool_calls=[ToolCall(name=c["name"], arguments=c["arguments"])
                                      for c in r.get("tool_calls", [])])
            seqs.append(renderer.tokenizer.encode(renderer.turn_text(msg)))
    return seqs


def vocabulary(spec: ModelSpec) -> VocabTable:
    renderer = qwen3_renderer(enable_thinking=False)
    seqs: list[Any] = []
    for harness in _harnesses(spec):
        if harness.partition(":")[0] != "whitebox":
            seqs += blackbox_sequences(spec, harness, renderer)
            continue
        seqs += [renderer.render_ids(c, add_generation_prompt=True) for c in episode_conversations(spec, harness)]
        # every system prompt and tool wording, so other S/T/O realizations stay inside the table
        for text in (*wb.SYSTEM_PROMPTS, json.dumps(wb.TOOLS_SPEC), wb.PLAN_REQUEST, wb.PLAN_ACK, wb.VERIFY_PROMPT,
                     wb.SUMMARY_PROMPT, wb.SUMMARY_PREFIX, wb.STATE_PROMPT, wb.STATE_PREFIX):
            seqs.append(renderer.tokenizer.encode(text))
    seqs.append(renderer.tokenizer.encode("".join(chr(c) for c in range(32, 127)) + "\n\t"))
    return VocabTable.from_sequences(seqs)


def ensure_model(spec: ModelSpec) -> Path:
    """Build the model at ``spec.path`` unless it is already there (idempotent)."""
    out = Path(spec.path)
    if (why := model_folder_problem(str(out), build=True)):
        raise ValueError(why)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        _check_built(spec, out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Runs started together with one model path (several seeds side by side) build it once: the others wait here.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists() and (out / "model.safetensors").exists():
            _check_built(spec, out)
            return out
        table = vocabulary(spec) if spec.vocabulary == "reduced" else None
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # what a build killed half-way left
        create_small_model(tmp, vocab=table, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
                           num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                           max_position_embeddings=spec.max_position_embeddings, seed=spec.seed,
                           mean_reply_tokens=spec.mean_reply_tokens, sliding_window=spec.sliding_window)
        tmp.rename(out)
    log.info("small policy built", path=str(out), vocab=table.size if table else "full")
    return out


def _check_built(spec: ModelSpec, out: Path) -> None:
    """A model already built at the path must have the shape the spec asks for: a changed spec would otherwise
    train the old model silently."""
    c = json.loads((out / "config.json").read_text())
    window = c.get("sliding_window") if "sliding_attention" in (c.get("layer_types") or []) else 0
    built = {"hidden_size": c.get("hidden_size"), "num_layers": c.get("num_hidden_layers"),
             "num_heads": c.get("num_attention_heads"), "num_kv_heads": c.get("num_key_value_heads"),
             "max_position_embeddings": c.get("max_position_embeddings"), "sliding_window": window or 0}
    differ = {k: (v, getattr(spec, k)) for k, v in built.items() if v != getattr(spec, k)}
    if differ:
        what = ", ".join(f"{k} {b} (asked {a})" for k, (b, a) in differ.items())
        raise ValueError(f"{out}: the model built there has {what}; [experiment.build_model] asks otherwise. "
                         "Set [run].model to a new path (or delete that folder) to build the asked one")
