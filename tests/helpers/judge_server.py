"""A real OpenAI-compatible judge endpoint for tests, run as a subprocess: ``python -m tests.helpers.judge_server``.

It answers ``POST /v1/chat/completions`` as the request's ``model`` says (anything after ``#`` is a tag, so that
each test can count its own requests):

- ``score:X``: a well-formed reply ``{"score": X, "reason": ...}`` (the reason carries :data:`REASON_CANARY`);
- ``sleep:S:X``: the same after S seconds (a judge that times out);
- ``flaky:N:X``: HTTP 503 to the first N requests of this model, then ``score:X``;
- ``garbage``: a chat completion whose text holds no score (it carries :data:`GARBAGE_CANARY`);
- ``notjson``: HTTP 200 with an HTML body;
- ``outside``: ``{"score": 7}``;
- ``e400``: HTTP 400;
- ``gullible:X``: a judge that obeys "ignore previous instructions" when it sees that phrase outside the workspace
  block (``<<<WORKSPACE nonce`` ... ``WORKSPACE nonce>>>``, the nonce taken from the opening marker): then it
  answers 1, else X.

With ``JUDGE_SERVER_KEY`` in its environment it answers 401 to a request without ``Authorization: Bearer <key>``.
``GET /requests`` lists what it received (model, messages, whether the key matched). It prints ``PORT <n>`` once
it listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.request import urlopen

from aiohttp import web

REASON_CANARY = "REASON-CANARY-7f3a"
GARBAGE_CANARY = "GARBAGE-CANARY-91c2"
TRIGGER = "ignore previous instructions"
_BLOCK = re.compile(r"<<<WORKSPACE ?(\S*)\n.*?WORKSPACE ?\1>>>", re.DOTALL)
ROOT = Path(__file__).resolve().parents[2]


def _completion(content: str) -> web.Response:
    return web.json_response({"id": "j", "object": "chat.completion", "model": "judge", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]})


def _score(x: float) -> web.Response:
    return _completion(json.dumps({"score": x, "reason": f"{REASON_CANARY} looks fine"}))


def _gullible(messages: list[dict[str, Any]], x: float) -> web.Response:
    outside = "\n".join(_BLOCK.sub("", str(m.get("content", ""))) for m in messages)
    return _score(1.0 if TRIGGER in outside.lower() else x)


class Server:
    def __init__(self, key: str):
        self.key = key
        self.received: list[dict[str, Any]] = []
        self.seen: Counter[str] = Counter()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = str(body.get("model", ""))
        auth = request.headers.get("Authorization", "")
        self.received.append({"model": model, "messages": body.get("messages", []),
                              "auth_ok": auth == f"Bearer {self.key}" if self.key else not auth})
        self.seen[model] += 1
        if self.key and auth != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        kind, *args = model.split("#", 1)[0].split(":")
        if kind == "score":
            return _score(float(args[0]))
        if kind == "sleep":
            await asyncio.sleep(float(args[0]))
            return _score(float(args[1]))
        if kind == "flaky":
            if self.seen[model] <= int(args[0]):
                return web.Response(status=503, text="overloaded")
            return _score(float(args[1]))
        if kind == "garbage":
            return _completion(f"{GARBAGE_CANARY} This looks good to me, maybe 0.9-ish overall.")
        if kind == "notjson":
            return web.Response(text="<html>502 bad gateway</html>", content_type="text/html")
        if kind == "outside":
            return _completion('{"score": 7}')
        if kind == "e400":
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        if kind == "gullible":
            return _gullible(body.get("messages", []), float(args[0]))
        return web.json_response({"error": {"message": f"unknown model {model}"}}, status=404)

    async def requests(self, _request: web.Request) -> web.Response:
        return web.json_response(self.received)


async def _main() -> None:
    server = Server(os.environ.get("JUDGE_SERVER_KEY", ""))
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/requests", server.requests)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"PORT {port}", flush=True)
    await asyncio.Event().wait()


# --------------------------------------------------------------------------------------------- for tests
class Running:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc = proc
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/v1"

    def requests(self, model: str | None = None) -> list[dict[str, Any]]:
        with urlopen(f"{self.base}/requests", timeout=10) as r:
            got = json.loads(r.read())
        return [x for x in got if model is None or x["model"] == model]


@contextmanager
def judge_server(key: str = "") -> Iterator[Running]:
    """The server in a subprocess, stopped afterwards."""
    env = {**os.environ, "JUDGE_SERVER_KEY": key, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.judge_server"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the server prints its port first; it dies (EOF) on an error
        if not line.startswith("PORT "):
            raise RuntimeError(f"judge server did not start (exit {proc.poll()}, {time.monotonic() - t0:.0f}s)")
        yield Running(proc, int(line.split()[1]))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    asyncio.run(_main())
