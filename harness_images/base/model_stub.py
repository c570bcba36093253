#!/usr/bin/env python3
"""A model that answers every Chat Completions request with "Done.", standard library only: what a Node harness
talks to while bridle fills its compile cache (pipeline/rollout/sandbox/task_images.py), so that the harness runs
its whole start-up and one turn with no policy behind it.

    model_stub.py --listen 127.0.0.1:8080 -- CMD ARGS...   # serve, then exec CMD (the forwarder's contract)

Streaming (``"stream": true``: server-sent events, a usage chunk, ``[DONE]``) and plain JSON answers; ``GET
/v1/models`` lists one model. The listening socket is bound before CMD starts; a forked child serves it and dies
with CMD.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, "/opt/bridle")  # the base image's forwarder: the same fork-then-exec contract
from forwarder import _die_with_parent

ANSWER = "Done."


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(json.dumps({"object": "list", "data": [{"id": "policy", "object": "model"}]}).encode(),
                   "application/json")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        model, now = request.get("model", "policy"), int(time.time())
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        head = {"id": "chatcmpl-stub", "created": now, "model": model}
        if not request.get("stream"):
            self._send(json.dumps({**head, "object": "chat.completion", "usage": usage, "choices": [{
                "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}]}).encode(),
                "application/json")
            return
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ANSWER},
                                   "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**chunk, "choices": [], "usage": usage},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")


def main(argv: list[str]) -> int:
    i = argv.index("--")
    listen, command = argv[:i], argv[i + 1:]
    host, _, port = (listen[listen.index("--listen") + 1] if "--listen" in listen else "127.0.0.1:8080").rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    parent = os.getpid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.setsid()
        _die_with_parent()
        if os.getppid() != parent:
            os._exit(0)
        try:
            server.serve_forever()
        finally:
            os._exit(0)
    server.socket.close()
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
