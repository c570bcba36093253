"""A small OpenAI-compatible Chat Completions server for tests: streams what a policy callable returns.

It speaks the way the bridle proxy does (docs/wire-protocols.md, Chat Completions): HTTP/1.1 with chunked
transfer, a role chunk first, ``: keepalive`` comments, content in pieces, tool-call deltas whose first
fragment carries index/id/name and later ones only argument pieces (fragments of different calls
interleaved), a usage chunk with ``choices: []`` and ``data: [DONE]``. Listens on 127.0.0.1 or a Unix socket.
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    """What the fake model answers: text and tool calls ``(name, arguments)``; arguments as a dict are
    JSON-encoded, as a str are sent verbatim (to test malformed JSON)."""

    content: str = ""
    tool_calls: list[tuple[str, dict | str]] = field(default_factory=list)


@dataclass
class Failure:
    """Answer with an HTTP error status, or (``mid_stream``) with a 200 stream carrying an error frame."""

    status: int = 500
    mid_stream: bool = False
    message: str = "engine failed"


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict


Policy = Callable[[dict, dict[str, str]], "Reply | Failure"]


def _pieces(text: str, n: int) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = {k.lower(): v for k, v in self.headers.items()}
        fake: FakeOpenAI = self.server.fake
        with fake.lock:
            fake.requests.append(Recorded(self.path, headers, body))
        if self.path != "/v1/chat/completions":
            return self._error(404, f"no route {self.path}")
        answer = fake.policy(body, headers)
        if isinstance(answer, Failure) and not answer.mid_stream:
            return self._error(answer.status, answer.message)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": body["model"],
        }

        def frame(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps({**base, **payload})
            self._chunk(f"data: {data}\n\n")

        def delta(d: dict, finish: str | None = None) -> None:
            frame({"choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]})

        delta({"role": "assistant", "content": ""})
        self._chunk(": keepalive\n\n")
        if isinstance(answer, Failure):
            frame(json.dumps({"error": {"message": answer.message, "type": "server_error"}}))
            self._chunk("")
            return
        for piece in _pieces(answer.content, 3) if answer.content else []:
            delta({"content": piece})
            self._chunk(": keepalive\n\n")
        args = [a if isinstance(a, str) else json.dumps(a) for _, a in answer.tool_calls]
        for i, (name, _) in enumerate(answer.tool_calls):
            delta(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": f"call_{len(fake.requests)}_{i}",
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
        # Argument pieces round-robin over the calls, so the harness must assemble by index.
        split = [_pieces(a, 3) for a in args]
        for r in range(max((len(s) for s in split), default=0)):
            for i, s in enumerate(split):
                if r < len(s):
                    delta({"tool_calls": [{"index": i, "function": {"arguments": s[r]}}]})
        delta({}, "tool_calls" if answer.tool_calls else "stop")
        frame({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
        frame("[DONE]")
        self._chunk("")

    def _chunk(self, text: str) -> None:
        data = text.encode("utf-8")
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _error(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"message": message, "type": "server_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeOpenAI


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    fake: FakeOpenAI

    def get_request(self):  # BaseHTTPRequestHandler expects a (host, port)-like client address
        sock, _ = super().get_request()
        return sock, ("unix", 0)


class FakeOpenAI:
    """``with FakeOpenAI(policy) as fake:`` serves until the block ends; ``fake.base_url`` for the harness."""

    def __init__(self, policy: Policy, unix_socket: str | None = None) -> None:
        self.policy = policy
        self.unix_socket = unix_socket
        self.requests: list[Recorded] = []
        self.lock = threading.Lock()

    def __enter__(self):
        if self.unix_socket:
            self.server = _UnixServer(self.unix_socket, _Handler)
            self.base_url = f"unix:{self.unix_socket}"
        else:
            self.server = _Server(("127.0.0.1", 0), _Handler)
            self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.server.fake = self
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
