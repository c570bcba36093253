"""The white-box harness's five components and their levels: the one definition bridle has of them.

A configuration such as ``S0T1O2C1W0`` picks a level 0, 1 or 2 for each of five components: S the system
prompt, T the tool interface, O the observation format, C context management, W the workflow. Every
configuration offers the same functions and asks for the same work, so the policy learns the task and not the
wording. This module holds what each level *is* (names, texts, tool names); ``observe``, ``context`` and
``episode`` hold what each level *does*. ``pipeline.rollout.harness_space`` builds the experiment design
(orthogonal array, held-out set, locality) on top of :class:`HarnessConfig` and :func:`offered_tools`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

COMPONENTS = ("S", "T", "O", "C", "W")
LEVELS = 3
REALIZATIONS: dict[str, tuple[str, str, str]] = {
    "S": ("direct", "product", "narrative"),
    "T": ("base_names", "semantic_aliases", "opaque_ids"),
    "O": ("raw", "simulated_infrastructure", "execution_metadata"),
    "C": ("full_history", "in_context_summary", "externalized_compaction"),
    "W": ("free_form", "plan_first", "progress_verification"),
}
ADAPTER = "whitebox"  # RolloutRequest.harness is "whitebox:<name>"


@dataclass(frozen=True, order=True)
class HarnessConfig:
    """One point of the space; hashable and ordered like its name."""

    s: int
    t: int
    o: int
    c: int
    w: int

    def __post_init__(self) -> None:
        for comp, level in zip(COMPONENTS, self.levels, strict=True):
            if not 0 <= level < LEVELS:
                raise ValueError(f"HarnessConfig.{comp.lower()}={level}: a level must be 0, 1 or 2")

    @classmethod
    def parse(cls, name: str) -> HarnessConfig:
        """``S0T1O2C1W0`` or ``whitebox:S0T1O2C1W0``."""
        bare = name.removeprefix(ADAPTER + ":")
        if len(bare) != 10 or tuple(bare[0::2]) != COMPONENTS or not all(ch in "012" for ch in bare[1::2]):
            raise ValueError(
                f"harness configuration {name!r}: expected a name like S0T1O2C1W0 (each level 0, 1 or 2)"
            )
        return cls(*(int(ch) for ch in bare[1::2]))

    @classmethod
    def from_levels(cls, levels: Sequence[int]) -> HarnessConfig:
        return cls(*(int(x) for x in levels))

    @property
    def levels(self) -> tuple[int, int, int, int, int]:
        return (self.s, self.t, self.o, self.c, self.w)

    @property
    def name(self) -> str:
        return "".join(f"{comp}{level}" for comp, level in zip(COMPONENTS, self.levels, strict=True))

    @property
    def adapter(self) -> str:
        return f"{ADAPTER}:{self.name}"

    def realizations(self) -> dict[str, str]:
        return {comp: REALIZATIONS[comp][level] for comp, level in zip(COMPONENTS, self.levels, strict=True)}

    def distance(self, other: HarnessConfig) -> int:
        """Hamming distance: the number of components whose realization differs."""
        return sum(a != b for a, b in zip(self.levels, other.levels, strict=True))

    def __str__(self) -> str:
        return self.name


# ------------------------------------------------------------------------------------------- S: system prompt
# Three wordings of the same requirements: work in the workspace with the tools, look before changing,
# change only what is needed, finish by answering without tool calls. Short on purpose: small policies
# have to read all of it on every call.
SYSTEM_PROMPTS = (
    (
        "You are a coding agent. Do the user's task in the current workspace using the tools. "
        "Read files before you change them and change only what the task needs. "
        "When the task is done, reply with a short summary and no tool calls."
    ),
    (
        "You are Forge Assistant, a product that delivers finished work for its users. "
        "Deliver the user's request in the project workspace with the tools provided. "
        "Check files before changing them; make only the changes requested. "
        "To hand over, reply with a brief summary and no tool calls."
    ),
    (
        "You are a careful engineer who has just picked up a ticket from a teammate. "
        "The workspace is yours; the tools are how you look around and make changes. "
        "You look before you change anything and change only what is needed. "
        "When the work is finished, you report back briefly, without calling tools."
    ),
)

# --------------------------------------------------------------------------------------------- C: context
# C1: above the summary budget, older turns are replaced by the model's summary.
SUMMARY_PROMPT = (
    "The conversation is getting long. Summarize the work so far: what is done, what remains, "
    "and the file names and facts still needed. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of the earlier work:\n"
# C2: above the compaction budget, the model writes the state, which is saved and starts a new segment.
STATE_PROMPT = (
    "The context is full and will be restarted. Write the state of the task: what is done, what remains, "
    "and the file names and facts still needed. Reply with the state only."
)
STATE_PREFIX = "\n\nState so far (also saved in {path}):\n"

# -------------------------------------------------------------------------------------------- W: workflow
PLAN_REQUEST = "\n\nBefore you use any tool, reply with a short numbered plan."  # W1, after the instruction
PLAN_ACK = "Plan noted. Now carry it out."
VERIFY_PROMPT = (  # W2, every N turns
    "Progress check: in one line, say what is done and what remains, and verify your last change. "
    "Then continue; reply without tool calls only when the task is complete."
)

# ---------------------------------------------------------------------------------------- T: tool interface
TOOLS_SPEC: dict = json.loads(Path(__file__).with_name("tools.json").read_text(encoding="utf-8"))
CANONICAL_TOOLS: tuple[str, ...] = tuple(TOOLS_SPEC["canonical"])


class ToolInterface(NamedTuple):
    """The tools of one T level: the ``tools`` payload of a request, offered name -> canonical name, and
    distractor name -> its fixed (useless) result."""

    tools: list[dict]
    to_canonical: dict[str, str]
    distractors: dict[str, str]


def tool_interface(level: int) -> ToolInterface:
    """The tool interface of realization T<level>, in the offered order."""
    names = TOOLS_SPEC["names"][f"T{level}"]
    defs = {}
    for canonical in CANONICAL_TOOLS:
        spec = TOOLS_SPEC["functions"][canonical]
        defs[names[canonical]] = (spec["description"], spec["parameters"])
    distractors = {}
    for d in TOOLS_SPEC["distractors"].get(f"T{level}", []):
        defs[d["name"]] = (d["description"], d["parameters"])
        distractors[d["name"]] = d["result"]
    order = TOOLS_SPEC["order"].get(f"T{level}", list(defs))
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": defs[name][0],
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": "string", "description": v} for k, v in defs[name][1].items()},
                    "required": list(defs[name][1]),
                },
            },
        }
        for name in order
    ]
    return ToolInterface(tools, {names[c]: c for c in CANONICAL_TOOLS}, distractors)


def tool_name_for(config: HarnessConfig, canonical: str) -> str:
    """The name under which ``config``'s tool interface offers the canonical tool (``read_file``, ...), so a
    policy scripted in canonical names can drive any T realization. Arguments keep their canonical names."""
    names = TOOLS_SPEC["names"][f"T{config.t}"]
    if canonical not in names:
        raise ValueError(
            f"unknown canonical tool {canonical!r}; expected one of {', '.join(CANONICAL_TOOLS)}"
        )
    return names[canonical]


def offered_tools(config: HarnessConfig) -> list[str]:
    """Every tool name the harness offers under ``config``, distractors included, in the offered order."""
    return [t["function"]["name"] for t in tool_interface(config.t).tools]
