"""Fuzzing every proxy endpoint: malformed JSON, wrong types, missing fields, huge bodies, bad or missing tokens.

Always a 4xx with a clear message (or a normal answer when the body happens to be valid), never a 5xx, and never a
record for an unauthenticated request.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import anyio.from_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.messages import CallStarted
from tests.helpers.proxyutil import running_proxy

ENDPOINTS = ["/v1/chat/completions", "/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens",
             "/v1/responses"]

VALID = {
    "/v1/chat/completions": {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
    "/v1/messages": {"model": "policy", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages?beta=true": {"model": "policy", "max_tokens": 20, "stream": True,
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "/v1/messages/count_tokens": {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "policy", "input": [{"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "hi"}]}]},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=12,
)


def mutate(body, path, value):
    """Replace the value at a path of keys/indices (the body is a fresh copy)."""
    body = json.loads(json.dumps(body))
    node = body
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


_DELETE = object()


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


@st.composite
def bodies(draw, endpoint):
    kind = draw(st.sampled_from(["raw", "json", "mutate", "delete"]))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    base = VALID[endpoint]
    ps = [p for p in paths(base) if p]
    p = draw(st.sampled_from(ps))
    if kind == "delete":
        return json.dumps(mutate(base, p, _DELETE)).encode()
    return json.dumps(mutate(base, p, draw(json_values))).encode()


@pytest.fixture(scope="module")
def proxy():
    with anyio.from_thread.start_blocking_portal() as portal:
        cm = running_proxy(max_body_bytes=64_000, context_len=4096)
        p, records, token = portal.call(cm.__aenter__)
        try:
            yield Client(p.base_url), records, token
        finally:
            portal.call(cm.__aexit__, None, None, None)


class Resp:
    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


class Client:
    """A plain stdlib HTTP client: no SDK between the fuzzer and the proxy."""

    def __init__(self, base_url: str) -> None:
        u = urlparse(base_url)
        self.host, self.port = u.hostname, u.port

    def post(self, path, content=None, json=None, headers=None):
        import json as _json

        body = content if content is not None else _json.dumps(json).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("POST", path, body=body, headers=headers or {})
            r = conn.getresponse()
            return Resp(r.status, r.read().decode("utf-8", "replace"))
        finally:
            conn.close()


def check_error(r: Resp) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        body = r.json()
        err = body.get("error")
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], body


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzz_authenticated(proxy, endpoint):
    client, _records, token = proxy

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(endpoint))
    def run(body):
        r = client.post(endpoint, content=body, headers={"x-api-key": token, "content-type": "application/json"})
        check_error(r)

    run()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzz_unauthenticated_records_nothing(proxy, endpoint):
    client, records, token = proxy
    before = len(records)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(endpoint) | st.just(json.dumps(VALID[endpoint]).encode()),
           auth=st.sampled_from(["none", "wrong-key", "wrong-bearer", "empty", "prefix"]))
    def run(body, auth):
        headers = {"content-type": "application/json"}
        if auth == "wrong-key":
            headers["x-api-key"] = "bridle-nope"
        elif auth == "wrong-bearer":
            headers["authorization"] = "Bearer bridle-nope"
        elif auth == "empty":
            headers["authorization"] = "Bearer "
        elif auth == "prefix":
            headers["x-api-key"] = token[:-1]
        r = client.post(endpoint, content=body, headers=headers)
        assert r.status_code == 401, r.text
        check_error(r)

    run()
    assert len(records) == before


def test_huge_bodies_are_413(proxy):
    client, records, token = proxy
    before = len(records)
    for endpoint in ENDPOINTS:
        big = dict(VALID[endpoint])
        big["pad"] = "x" * 100_000
        r = client.post(endpoint, json=big, headers={"x-api-key": token, "content-type": "application/json"})
        assert r.status_code == 413
        check_error(r)
    assert not [r for r in records[before:] if isinstance(r, CallStarted)]


def test_prompt_over_context_is_a_400_not_a_crash(proxy):
    client, _records, token = proxy
    body = dict(VALID["/v1/chat/completions"], messages=[{"role": "user", "content": "word " * 6000}])
    r = client.post("/v1/chat/completions", json=body,
                    headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
