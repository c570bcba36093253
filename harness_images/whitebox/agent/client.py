"""Streaming OpenAI Chat Completions over TCP or a Unix socket, standard library only.

One connection per call (``http.client``); the response is read as server-sent events and the
``chat.completion.chunk`` payloads are assembled into one :class:`Completion`. Connection failures, 408/409/
429/5xx (unless the server says ``x-should-retry: false``) and broken streams are retried.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from .errors import ApiError, UsageError

log = logging.getLogger("whitebox")


class _Lines(Protocol):
    def readline(self) -> bytes: ...


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


def iter_sse_data(resp: _Lines) -> Iterator[str]:
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


def assemble_stream(events: Iterable[str]) -> Completion:
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
