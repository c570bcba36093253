"""The agent loop: call the model, run the tool calls it makes, manage the context, until it answers without
tool calls or the turns run out. The workflow component lives here: W1 asks for a plan before any tool, W2
asks for a progress check every N turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .client import ChatClient, Completion
from .components import PLAN_ACK, PLAN_REQUEST, SYSTEM_PROMPTS, VERIFY_PROMPT, HarnessConfig, tool_interface
from .context import Budgets, Context, message_chars
from .errors import ToolError
from .observe import observe
from .tools import ToolResult, Tools, parse_arguments
from .transcript import Transcript


@dataclass
class Episode:
    config: HarnessConfig
    client: ChatClient
    tools: Tools
    transcript: Transcript
    instruction: str
    max_turns: int
    verify_every: int  # W2
    budgets: Budgets  # C1, C2
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    segment: int = 0
    calls: int = 0
    outputs: dict[str, str] = field(default_factory=dict)  # tool call id -> unwrapped result, for digests

    def __post_init__(self) -> None:
        self.tool_defs, self.to_canonical, self.distractors = tool_interface(self.config.t)
        self.params = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in self.tool_defs}
        self.system = SYSTEM_PROMPTS[self.config.s]
        self.context = Context(
            self.config.c, self.budgets, self.system, self.instruction, self.tools.workspace
        )

    def run(self) -> str:
        """Play the episode; returns why it ended ("answer" or "max_turns")."""
        c = self.config
        first = self.instruction + (PLAN_REQUEST if c.w == 1 else "")
        self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": first}]
        self.transcript.write(
            "start",
            config=c.name,
            realizations=c.realizations(),
            system_prompt=self.system,
            tools=[t["function"]["name"] for t in self.tool_defs],
            max_turns=self.max_turns,
        )
        awaiting_plan = c.w == 1
        while self.turn < self.max_turns:
            self.turn += 1
            completion = self._call(self.messages, "main")
            self.messages.append(self._assistant_message(completion))
            if awaiting_plan:
                awaiting_plan = False
                self.transcript.write("plan", turn=self.turn, segment=self.segment, text=completion.content)
                if not completion.tool_calls:
                    self.messages.append({"role": "user", "content": PLAN_ACK})
                    continue
            if not completion.tool_calls:
                self.transcript.write(
                    "end",
                    reason="answer",
                    turns=self.turn,
                    segments=self.segment + 1,
                    answer=completion.content,
                )
                return "answer"
            for call in completion.tool_calls:
                self.messages.append(self._execute(call))
            self._manage_context()
            if c.w == 2 and self.turn % self.verify_every == 0:
                self.messages.append({"role": "user", "content": VERIFY_PROMPT})
                self.transcript.write(
                    "verification", turn=self.turn, segment=self.segment, prompt=VERIFY_PROMPT
                )
        self.transcript.write("end", reason="max_turns", turns=self.turn, segments=self.segment + 1)
        return "max_turns"

    def _call(self, messages: list[dict], label: str) -> Completion:
        self.transcript.write(
            "request",
            turn=self.turn,
            segment=self.segment,
            label=label,
            chars=message_chars(messages),
            messages=[
                {
                    "role": m["role"],
                    "chars": len(m.get("content") or ""),
                    "tool_calls": len(m.get("tool_calls") or []),
                }
                for m in messages
            ],
        )
        completion = self.client.complete(
            messages, self.tool_defs, label=label, tool_choice="auto" if label == "main" else "none"
        )
        self.transcript.write(
            "response",
            turn=self.turn,
            segment=self.segment,
            label=label,
            content=completion.content,
            tool_calls=completion.tool_calls,
            finish_reason=completion.finish_reason,
            usage=completion.usage,
        )
        return completion

    def _assistant_message(self, completion: Completion) -> dict:
        msg: dict = {
            "role": "assistant",
            "content": completion.content or (None if completion.tool_calls else ""),
        }
        if completion.tool_calls:
            for i, tc in enumerate(completion.tool_calls):
                tc["id"] = tc["id"] or f"call_{self.turn}_{i}"
            msg["tool_calls"] = [
                {
                    "id": tc["id"],
                    "type": "function",
                    "function": {"name": tc["name"], "arguments": tc["arguments"]},
                }
                for tc in completion.tool_calls
            ]
        return msg

    def _execute(self, call: dict) -> dict:
        self.calls += 1
        name = call["name"]
        start = time.monotonic()
        canonical = self.to_canonical.get(name)
        try:
            if name not in self.params:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.params)}")
            args = parse_arguments(call["arguments"], self.params[name])
            if canonical is None:
                result = ToolResult(self.distractors[name], True, 0)
            else:
                result = self.tools.run(canonical, args)
        except ToolError as e:
            result = ToolResult(f"Error: {e}", False, 1)
        duration_ms = int((time.monotonic() - start) * 1000)
        observation = observe(self.config.o, result, name, self.calls, duration_ms)
        self.outputs[call["id"]] = result.output
        self.transcript.write(
            "tool",
            turn=self.turn,
            segment=self.segment,
            id=call["id"],
            name=name,
            canonical=canonical,
            arguments=call["arguments"],
            ok=result.ok,
            exit_code=result.exit_code,
            output=result.output,
            observation=observation,
        )
        return {"role": "tool", "tool_call_id": call["id"], "content": observation}

    def _manage_context(self) -> None:
        rewrite = self.context.manage(
            self.messages, self.outputs, lambda msgs: self._call(msgs, "compaction").content
        )
        if rewrite is None:
            return
        self.messages = rewrite.messages
        if rewrite.new_segment:
            self.segment += 1
        self.transcript.write(rewrite.event, turn=self.turn, segment=self.segment, **rewrite.record)
