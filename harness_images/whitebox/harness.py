#!/usr/bin/env python3
"""bridle's white-box harness: one configurable agent loop, standard library only.

A configuration such as ``S0T1O2C1W0`` picks one of three realizations for each of five components
(system prompt, tool interface, observation format, context management, workflow; DESIGN.md section 7).
Every configuration offers the same functions and asks for the same work, so the policy learns the task and
not the wording. The harness talks OpenAI Chat Completions (streaming, with tools) to the bridle proxy over
TCP or a Unix socket, runs the tools in the workspace and records each step in a JSONL transcript.

Exit status: 0 the episode ended (the model answered without tool calls, or max turns), 1 the API failed,
2 the invocation was wrong (bad arguments, missing files, no API key).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS_SPEC = json.loads((HERE / "tools.json").read_text(encoding="utf-8"))
CONFIG_RE = re.compile(r"^S([0-2])T([0-2])O([0-2])C([0-2])W([0-2])$")
COMPONENTS = "STOCW"
REALIZATIONS = {
    "S": ("direct", "product", "narrative"),
    "T": ("base_names", "semantic_aliases", "opaque_ids"),
    "O": ("raw", "simulated_infrastructure", "execution_metadata"),
    "C": ("full_history", "in_context_summary", "externalized_compaction"),
    "W": ("free_form", "plan_first", "progress_verification"),
}

log = logging.getLogger("whitebox")

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
PLAN_REQUEST = "\n\nBefore you use any tool, reply with a short numbered plan."
PLAN_ACK = "Plan noted. Now carry it out."
VERIFY_PROMPT = (
    "Progress check: in one line, say what is done and what remains, and verify your last change. "
    "Then continue; reply without tool calls only when the task is complete."
)
SUMMARY_PROMPT = (
    "The conversation is getting long. Summarize the work so far: what is done, what remains, "
    "and the file names and facts still needed. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of the earlier work:\n"
STATE_PROMPT = (
    "The context is full and will be restarted. Write the state of the task: what is done, what remains, "
    "and the file names and facts still needed. Reply with the state only."
)
STATE_PREFIX = "\n\nState so far (also saved in {path}):\n"


class ApiError(Exception):
    """The model endpoint failed; ``retryable`` says whether a new attempt may succeed."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class ToolError(Exception):
    """A tool call the model got wrong or that failed; its text goes back to the model as the result."""


class UsageError(Exception):
    """The harness was started wrongly (bad config name, missing file, no API key)."""


# ------------------------------------------------------------------------------------------------ transport
class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: Docker sandboxes reach the proxy through a mounted socket."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass
class Completion:
    content: str
    tool_calls: list[dict]  # {"id", "name", "arguments"} with arguments exactly as streamed
    finish_reason: str | None
    usage: dict | None


def iter_sse_data(resp) -> Iterator[str]:
    """Yield the data payload of each server-sent event; comments (``: keepalive``) and other fields are
    skipped, multi-line data is joined with newlines as the SSE spec says."""
    data_lines: list[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            if data_lines:
                yield "\n".join(data_lines)
            return
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data_lines:
                yield "\n".join(data_lines)
                data_lines = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data_lines.append(value.removeprefix(" "))


def assemble_stream(events) -> Completion:
    """Build one completion from chat.completion.chunk payloads. Tool-call fragments are keyed by their
    ``index``: the first carries id and name, later ones only argument pieces, and fragments of different
    calls may interleave."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    usage = None
    done = False
    for data in events:
        if data.strip() == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise ApiError(f"stream frame is not JSON ({e}): {data[:200]!r}", retryable=True) from e
        if not isinstance(chunk, dict):
            raise ApiError(f"stream frame is not an object: {data[:200]!r}", retryable=True)
        if chunk.get("error"):
            raise ApiError(f"error inside the stream: {json.dumps(chunk['error'])[:500]}", retryable=True)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for frag in delta.get("tool_calls") or []:
                index = frag.get("index")
                if not isinstance(index, int):
                    raise ApiError(f"tool_call delta without an integer index: {frag!r}", retryable=True)
                slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
                if frag.get("id") and not slot["id"]:
                    slot["id"] = frag["id"]
                fn = frag.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not done and finish is None:
        raise ApiError("stream ended before [DONE] and without a finish_reason", retryable=True)
    return Completion("".join(content), [calls[i] for i in sorted(calls)], finish, usage)


class ChatClient:
    """Streaming Chat Completions client. One connection per call; retries connection failures, 408/409/
    429/5xx (unless the server says ``x-should-retry: false``) and broken streams."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        *,
        timeout: float,
        retries: int,
        temperature: float | None,
        max_tokens: int | None,
    ) -> None:
        if base_url.startswith("unix:"):
            path = base_url[len("unix:") :]
            if not path:
                raise UsageError("--base-url unix: needs a socket path, e.g. unix:/run/bridle/proxy.sock")
            self.socket_path, self.host, self.port, self.tls = path, None, None, False
            self.prefix = "/v1"
        else:
            url = urllib.parse.urlsplit(base_url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise UsageError(f"--base-url {base_url!r}: expected http(s)://host:port/v1 or unix:/path")
            self.socket_path, self.host, self.port = None, url.hostname, url.port
            self.tls = url.scheme == "https"
            self.prefix = url.path.rstrip("/")
        self.api_key, self.model, self.timeout, self.retries = api_key, model, timeout, retries
        self.temperature, self.max_tokens = temperature, max_tokens

    def _connection(self) -> http.client.HTTPConnection:
        if self.socket_path:
            return UnixHTTPConnection(self.socket_path, self.timeout)
        cls = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def complete(
        self, messages: list[dict], tools: list[dict], *, label: str, tool_choice: str = "auto"
    ) -> Completion:
        body = {
            "model": self.model,
            "messages": messages,
            "tools": tools,
            "tool_choice": tool_choice,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        payload = json.dumps(body).encode("utf-8")
        for attempt in range(self.retries + 1):
            try:
                return self._call(payload, label)
            except ApiError as e:
                if not e.retryable or attempt == self.retries:
                    raise
                log.warning("model call failed (%s); retry %d of %d", e, attempt + 1, self.retries)
                time.sleep(min(2.0**attempt, 8.0))
        raise AssertionError("unreachable")

    def _call(self, payload: bytes, label: str) -> Completion:
        conn = self._connection()
        try:
            conn.request(
                "POST",
                self.prefix + "/chat/completions",
                body=payload,
                headers={
                    "Content-Type": "application/json",
                    "Accept": "text/event-stream",
                    "Authorization": f"Bearer {self.api_key}",
                    # Lets the proxy label auxiliary calls without guessing from the prompt text.
                    "X-Bridle-Call-Label": label,
                    "User-Agent": "bridle-whitebox/1",
                },
            )
            resp = conn.getresponse()
            if resp.status != 200:
                text = resp.read().decode("utf-8", "replace")[:500]
                retryable = (resp.status in (408, 409, 429) or resp.status >= 500) and resp.getheader(
                    "x-should-retry", ""
                ).lower() != "false"
                raise ApiError(f"HTTP {resp.status} from {self.prefix}/chat/completions: {text}", retryable)
            return assemble_stream(iter_sse_data(resp))
        except (OSError, http.client.HTTPException) as e:
            raise ApiError(f"connection to the model endpoint failed: {e!r}", retryable=True) from e
        finally:
            conn.close()


# ---------------------------------------------------------------------------------------------------- tools
@dataclass
class ToolResult:
    output: str
    ok: bool
    exit_code: int


class Tools:
    """The seven functions, run against the workspace. Argument problems raise ToolError so the model sees
    what it got wrong and can try again."""

    def __init__(self, workspace: Path, corpus: Path, command_timeout: float, max_output_chars: int) -> None:
        self.workspace, self.corpus = workspace, corpus
        self.command_timeout, self.max_output_chars = command_timeout, max_output_chars

    def run(self, canonical: str, args: dict) -> ToolResult:
        try:
            output, code = getattr(self, "_" + canonical)(**args)
        except (ToolError, OSError) as e:  # an unreadable file should reach the model, not end the episode
            return ToolResult(self._clip(f"Error: {e}"), False, 1)
        return ToolResult(self._clip(output), code == 0, code)

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n[... {len(text) - self.max_output_chars} more characters]"

    def _path(self, path: str) -> Path:
        if not path.strip():
            raise ToolError("path is empty")
        return (self.workspace / path).resolve()

    def _read_file(self, path: str) -> tuple[str, int]:
        p = self._path(path)
        if p.is_dir():
            raise ToolError(f"{path} is a directory")
        try:
            return p.read_text(encoding="utf-8", errors="replace"), 0
        except FileNotFoundError:
            raise ToolError(f"{path} does not exist") from None
        except OSError as e:
            raise ToolError(f"cannot read {path}: {e.strerror}") from None

    def _write_file(self, path: str, content: str) -> tuple[str, int]:
        p = self._path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content, encoding="utf-8")
        except OSError as e:
            raise ToolError(f"cannot write {path}: {e.strerror}") from None
        return f"Wrote {len(content)} characters to {path}.", 0

    def _edit_file(self, path: str, old: str, new: str) -> tuple[str, int]:
        if not old:
            raise ToolError("old is empty; give the exact text to replace")
        text, _ = self._read_file(path)
        count = text.count(old)
        if count == 0:
            raise ToolError(f"old text not found in {path}")
        if count > 1:
            raise ToolError(f"old text occurs {count} times in {path}; include more context")
        try:
            self._path(path).write_text(text.replace(old, new, 1), encoding="utf-8")
        except OSError as e:
            raise ToolError(f"cannot write {path}: {e.strerror}") from None
        return f"Edited {path}.", 0

    def _bash(self, command: str) -> tuple[str, int]:
        shell = shutil.which("bash") or "/bin/sh"
        return self._process([shell, "-c", command], None)

    def _python(self, code: str) -> tuple[str, int]:
        return self._process([sys.executable, "-"], code)

    def _process(self, argv: list[str], stdin_text: str | None) -> tuple[str, int]:
        # Own session, so a timeout kills the command's children too (they would hold the pipe open).
        proc = subprocess.Popen(
            argv,
            cwd=self.workspace,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(
                stdin_text.encode() if stdin_text is not None else None, timeout=self.command_timeout
            )
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            text = out.decode("utf-8", "replace")
            raise ToolError(f"timed out after {self.command_timeout:g} s; output so far:\n{text}") from None
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            text += f"\n(exit code {proc.returncode})"
        return text, proc.returncode

    def _documents(self) -> list[Path]:
        if not self.corpus.is_dir():
            raise ToolError("there is no local corpus in this workspace")
        return sorted(p for p in self.corpus.rglob("*") if p.is_file() and p.name != "urls.json")

    def _search(self, query: str) -> tuple[str, int]:
        terms = re.findall(r"\w+", query.lower())
        if not terms:
            raise ToolError("query has no words")
        docs = [(p, p.read_text(encoding="utf-8", errors="replace")) for p in self._documents()]
        tokens = {p: re.findall(r"\w+", text.lower()) for p, text in docs}
        n = len(docs)
        scored = []
        for p, text in docs:
            score = 0.0
            for t in set(terms):
                tf = tokens[p].count(t)
                if tf:
                    df = sum(1 for q in tokens if t in tokens[q])
                    score += (1 + math.log(tf)) * math.log(1 + n / df)
            if score > 0:
                scored.append((-score, str(p.relative_to(self.corpus)), text))
        if not scored:
            return f"No documents match {query!r}.", 0
        lines = []
        for neg, rel, text in sorted(scored)[:5]:
            low = text.lower()
            at = min((low.find(t) for t in terms if low.find(t) >= 0), default=0)
            snippet = " ".join(text[max(0, at - 60) : at + 140].split())
            lines.append(f"corpus://{rel}\n  {snippet}")
        return "\n".join(lines), 0

    def _fetch(self, url: str) -> tuple[str, int]:
        self._documents()
        rel = None
        index = self.corpus / "urls.json"
        if index.is_file():
            try:
                rel = json.loads(index.read_text(encoding="utf-8")).get(url)
            except (json.JSONDecodeError, AttributeError):
                raise ToolError("the corpus index urls.json is broken") from None
        if rel is None:
            rel = url.removeprefix("corpus://")
        p = (self.corpus / rel).resolve()
        if not p.is_relative_to(self.corpus.resolve()) or not p.is_file():
            raise ToolError(f"{url} is not in the local corpus (there is no network access)")
        return p.read_text(encoding="utf-8", errors="replace"), 0


def tool_interface(level: int) -> tuple[list[dict], dict[str, str], dict[str, str]]:
    """For realization T<level>: the tools payload, offered name -> canonical name, and distractor name ->
    its fixed (useless) result."""
    names = TOOLS_SPEC["names"][f"T{level}"]
    defs = {}
    for canonical in TOOLS_SPEC["canonical"]:
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
    return tools, {names[c]: c for c in TOOLS_SPEC["canonical"]}, distractors


def parse_arguments(raw: str, expected: list[str]) -> dict:
    """The model's argument JSON, checked against the parameter names (all strings)."""
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"arguments are not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    missing = [k for k in expected if k not in args]
    extra = [k for k in args if k not in expected]
    if missing or extra:
        raise ToolError(f"expected arguments {expected}; missing {missing}, unexpected {extra}")
    wrong = [k for k in expected if not isinstance(args[k], str)]
    if wrong:
        raise ToolError(f"arguments {wrong} must be strings")
    return args


# ------------------------------------------------------------------------------------------------ observation
def observe(level: int, result: ToolResult, name: str, seq: int, duration_ms: int) -> str:
    """The same tool result as the model sees it under O<level>."""
    if level == 0:
        return result.output
    status = "ok" if result.ok else "failed"
    if level == 1:
        return (
            f"[sandbox-runner] job {seq:04d} scheduled on worker-1\n"
            f"[sandbox-runner] exec {name}; streaming output\n"
            f"{result.output}\n"
            f"[sandbox-runner] job {seq:04d} {status}; released worker-1"
        )
    return (
        f"--- execution metadata ---\ntool: {name}\nstatus: {status}\nexit_code: {result.exit_code}\n"
        f"duration_ms: {duration_ms}\noutput_chars: {len(result.output)}\n--- output ---\n{result.output}"
    )


# ---------------------------------------------------------------------------------------------------- episode
class Transcript:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self.file.write(
            json.dumps({"event": event, "t": round(time.time(), 3), **fields}, ensure_ascii=False)
        )
        self.file.write("\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def message_chars(messages: list[dict]) -> int:
    total = 0
    for m in messages:
        total += len(m.get("content") or "")
        for tc in m.get("tool_calls") or []:
            total += len(tc["function"]["name"]) + len(tc["function"]["arguments"])
    return total


def turn_groups(body: list[dict]) -> list[list[dict]]:
    """Split messages into groups that each start at an assistant message, so a group's tool calls and
    their results are never separated."""
    groups: list[list[dict]] = []
    for m in body:
        if m["role"] == "assistant" or not groups:
            groups.append([])
        groups[-1].append(m)
    return groups


def digest(messages: list[dict], outputs: dict[str, str]) -> str:
    """A mechanical account of messages, used when the model returns an empty summary. ``outputs`` maps a
    tool call id to its unwrapped result, so O1/O2 wrappers do not crowd out the content."""
    lines = []
    for m in messages:
        for tc in m.get("tool_calls") or []:
            lines.append(f"- called {tc['function']['name']} {tc['function']['arguments'][:120]}")
        if m["role"] == "tool":
            first = outputs.get(m["tool_call_id"], m.get("content") or "").strip().splitlines()
            lines.append(f"  -> {first[0][:120] if first else '(no output)'}")
        elif m["role"] in ("user", "assistant") and m.get("content"):
            lines.append(f"- {m['role']}: {m['content'].strip()[:200]}")
    return "\n".join(lines) or "(nothing yet)"


@dataclass
class Episode:
    config: dict[str, int]
    client: ChatClient
    tools: Tools
    transcript: Transcript
    instruction: str
    max_turns: int
    summary_budget: int
    compaction_budget: int
    keep_recent: int
    verify_every: int
    state_file: str
    messages: list[dict] = field(default_factory=list)
    turn: int = 0
    segment: int = 0
    calls: int = 0
    state: str = ""
    outputs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tool_defs, self.to_canonical, self.distractors = tool_interface(self.config["T"])
        self.params = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in self.tool_defs}
        self.system = SYSTEM_PROMPTS[self.config["S"]]

    def run(self) -> str:
        """Play the episode; returns why it ended ("answer" or "max_turns")."""
        c = self.config
        first = self.instruction + (PLAN_REQUEST if c["W"] == 1 else "")
        self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": first}]
        self.transcript.write(
            "start",
            config="".join(f"{k}{c[k]}" for k in COMPONENTS),
            realizations={k: REALIZATIONS[k][c[k]] for k in COMPONENTS},
            system_prompt=self.system,
            tools=[t["function"]["name"] for t in self.tool_defs],
            max_turns=self.max_turns,
        )
        awaiting_plan = c["W"] == 1
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
            if c["W"] == 2 and self.turn % self.verify_every == 0:
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
        observation = observe(self.config["O"], result, name, self.calls, duration_ms)
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
        level = self.config["C"]
        chars = message_chars(self.messages)
        if level == 1 and chars > self.summary_budget:
            self._summarize(chars)
        elif level == 2 and chars > self.compaction_budget:
            self._compact(chars)

    def _summarize(self, chars: int) -> None:
        head, groups = self.messages[:2], turn_groups(self.messages[2:])
        if len(groups) <= self.keep_recent:
            return
        old, recent = groups[: len(groups) - self.keep_recent], groups[len(groups) - self.keep_recent :]
        completion = self._call(self.messages + [{"role": "user", "content": SUMMARY_PROMPT}], "compaction")
        old_msgs = [m for g in old for m in g]
        summary, source = completion.content.strip(), "model"
        if not summary:
            summary, source = digest(old_msgs, self.outputs), "harness"
        self.messages = (
            head + [{"role": "user", "content": SUMMARY_PREFIX + summary}] + [m for g in recent for m in g]
        )
        self.transcript.write(
            "summary",
            turn=self.turn,
            segment=self.segment,
            chars_before=chars,
            chars_after=message_chars(self.messages),
            replaced_messages=len(old_msgs),
            source=source,
            summary=summary,
        )

    def _compact(self, chars: int) -> None:
        body = self.messages[2:]
        if not any(m["role"] == "assistant" for m in body):
            return
        completion = self._call(self.messages + [{"role": "user", "content": STATE_PROMPT}], "compaction")
        state, source = completion.content.strip(), "model"
        if not state:  # the model saw the earlier state in its context; the digest has to carry it along
            state, source = (self.state + "\n" if self.state else "") + digest(body, self.outputs), "harness"
        self.state = state
        state_path = self.tools.workspace / self.state_file
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(state + "\n", encoding="utf-8")
        self.segment += 1
        self.messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.instruction + STATE_PREFIX.format(path=self.state_file) + state},
        ]
        self.transcript.write(
            "segment",
            turn=self.turn,
            segment=self.segment,
            chars_before=chars,
            chars_after=message_chars(self.messages),
            state_file=self.state_file,
            source=source,
            state=state,
        )


# -------------------------------------------------------------------------------------------------------- CLI
def parse_config(name: str) -> dict[str, int]:
    m = CONFIG_RE.match(name.removeprefix("whitebox:"))
    if not m:
        raise UsageError(f"--config {name!r}: expected a name like S0T1O2C1W0 (each level 0, 1 or 2)")
    return {k: int(v) for k, v in zip(COMPONENTS, m.groups())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="bridle white-box harness (Chat Completions, streaming, tools)")
    p.add_argument("--config", required=True, help="configuration name, e.g. S0T1O2C1W0")
    p.add_argument("--workspace", required=True, type=Path, help="directory the task works in")
    p.add_argument("--instruction-file", required=True, type=Path, help="file holding the task instruction")
    p.add_argument("--base-url", required=True, help="http://host:port/v1 or unix:/path/to/socket")
    p.add_argument("--model", default="policy")
    p.add_argument("--max-turns", type=int, default=30, help="main model calls at most")
    p.add_argument("--transcript", required=True, type=Path, help="JSONL file the episode is recorded to")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--corpus", type=Path, help="local search/fetch corpus (default WORKSPACE/corpus)")
    p.add_argument("--summary-budget-chars", type=int, default=24000, help="C1: summarize above this")
    p.add_argument("--compaction-budget-chars", type=int, default=12000, help="C2: new segment above this")
    p.add_argument("--keep-recent-turns", type=int, default=1, help="C1: turns kept verbatim")
    p.add_argument("--verify-every", type=int, default=4, help="W2: progress check every N turns")
    p.add_argument("--state-file", default=".harness_state.md", help="C2: state file, relative to workspace")
    p.add_argument("--command-timeout", type=float, default=60.0, help="bash/python time limit (s)")
    p.add_argument("--max-output-chars", type=int, default=8000, help="tool output beyond this is cut")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per model call (s)")
    p.add_argument("--api-retries", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("whitebox %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        config = parse_config(args.config)
        api_key = os.environ.get("BRIDLE_API_KEY")
        if not api_key:
            raise UsageError("BRIDLE_API_KEY is not set; the proxy needs the rollout's token")
        if args.max_turns < 1 or args.verify_every < 1 or args.keep_recent_turns < 1:
            raise UsageError("--max-turns, --verify-every and --keep-recent-turns must be at least 1")
        workspace = args.workspace.resolve()
        if not workspace.is_dir():
            raise UsageError(f"--workspace {args.workspace} is not a directory")
        try:
            instruction = args.instruction_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise UsageError(f"--instruction-file {args.instruction_file}: {e.strerror}") from None
        client = ChatClient(
            args.base_url,
            api_key,
            args.model,
            timeout=args.request_timeout,
            retries=args.api_retries,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
        )
    except UsageError as e:
        log.error("%s", e)
        return 2
    corpus = (args.corpus or workspace / "corpus").resolve()
    tools = Tools(workspace, corpus, args.command_timeout, args.max_output_chars)
    transcript = Transcript(args.transcript)
    episode = Episode(
        config,
        client,
        tools,
        transcript,
        instruction,
        args.max_turns,
        args.summary_budget_chars,
        args.compaction_budget_chars,
        args.keep_recent_turns,
        args.verify_every,
        args.state_file,
    )
    try:
        reason = episode.run()
    except ApiError as e:
        transcript.write(
            "end", reason="api_error", turns=episode.turn, segments=episode.segment + 1, error=str(e)
        )
        log.error("model API failed: %s", e)
        return 1
    finally:
        transcript.close()
    log.info("episode ended (%s) after %d turns", reason, episode.turn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
