"""SGLang 0.5.23's weight-version spans as the client reads them and the embedded engine writes them, and the
client's use of SGLang's API: it sends and reads exactly the keys :mod:`pipeline.serving.sglang_api` lists (which
tests/serving/test_sglang_fidelity.py checks against SGLang's source)."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import VersionSpan
from pipeline.serving import sglang_api as api
from pipeline.serving.engine import EngineProtocolError
from pipeline.serving.engine_call import result_versions
from pipeline.serving.sglang_api import read_weight_versions, write_weight_versions
from pipeline.serving.sglang_client import HttpEngine, parse_generate
from tests.helpers.sglang_record import embedded_answer, record_client


def answer(n: int, spans: Any, finish: Any = None, version: str = "4") -> dict:
    return {
        "text": "",
        "output_ids": list(range(100, 100 + n)),
        "meta_info": {
            "id": "r",
            "finish_reason": finish or {"type": "length", "length": n},
            "prompt_tokens": 3,
            "completion_tokens": n,
            "weight_version": version,
            "weight_versions": spans,
            "output_token_logprobs": [[-0.5, 100 + i, None] for i in range(n)],
        },
    }


def test_a_call_spanning_an_update_keeps_each_tokens_version():
    """Tokens 0-1 sampled by version 3, tokens 2-4 by version 4 (the update landed after token 1)."""
    res = parse_generate(answer(5, [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]),
                         "r")
    assert res.version_spans == [(0, "3"), (2, "4")] and res.weight_version == "4"
    assert res.spans() == [VersionSpan(0, 3), VersionSpan(2, 4)]
    assert result_versions(res, fallback=9) == [VersionSpan(0, 3), VersionSpan(2, 4)]
    # two updates, the second after the last token but before the answer: its version sampled nothing
    two = parse_generate(answer(4, [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 4}],
                                version="4"), "r")
    assert two.spans() == [VersionSpan(0, 3), VersionSpan(1, 4)]


def test_one_version_and_empty_outputs():
    assert parse_generate(answer(3, [{"version": "7", "start": 0, "end": 3}], version="7"), "r").version_spans == [
        (0, "7")
    ]
    aborted = answer(0, [{"version": "7", "start": 0, "end": 0}], finish={"type": "abort", "message": "x"})
    res = parse_generate(aborted, "r")
    assert res.version_spans == [] and result_versions(res, fallback=7) == [VersionSpan(0, 7)]
    # extra keys in a span are ignored (SGLang's contract ignores unknown keys)
    extra = [{"version": "7", "start": 0, "end": 2, "note": "x"}]
    assert parse_generate(answer(2, extra), "r").version_spans == [(0, "7")]


@pytest.mark.parametrize(
    ("spans", "needle"),
    [
        ([], "non-empty list"),
        ({"version": "3", "start": 0, "end": 4}, "non-empty list"),
        ([["3", 0, 4]], "not an object"),  # the scheduler's internal array form never reaches HTTP clients
        ([{"version": "3", "start": 0}], "not an object"),
        ([{"version": 3, "start": 0, "end": 4}], "string version"),
        ([{"version": "3", "start": False, "end": 4}], "integer start"),
        ([{"version": "3", "start": 1, "end": 4}], "starts at 1"),
        ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 4}], "starts at 3"),
        ([{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 2, "end": 4}], "starts at 2"),
        ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 2},
          {"version": "5", "start": 2, "end": 4}], "empty"),
        ([{"version": "3", "start": 0, "end": 3}], "end at token 3 but the answer has 4"),
        ([{"version": "3", "start": 0, "end": 5}], "end at token 5"),
    ],
)
def test_malformed_spans_are_refused_naming_the_field(spans, needle):
    with pytest.raises(EngineProtocolError, match=r"request r: meta_info\.weight_versions: .*" + needle):
        parse_generate(answer(4, spans), "r")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.sets(st.integers(1, 39), max_size=5), st.integers(0, 3))
def test_written_spans_read_back_exactly(n, cuts, first):
    starts = [(s, str(first + i)) for i, s in enumerate([0, *sorted(c for c in cuts if c < n)])] if n else []
    written = write_weight_versions(starts, n, "99")
    assert written[0]["start"] == 0 and written[-1]["end"] == n
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(written))
    assert read_weight_versions(written, n) == starts
    if n == 0:
        assert written == [{"version": "99", "start": 0, "end": 0}]


def test_the_embedded_engine_answers_sglang_spans():
    """Tokens 0-1 by version 3, 2-4 by version 4; the engine is at version 5 by the time it answers."""
    done = embedded_answer(5, [(0, "3"), (2, "4")], {"type": "length", "length": 5})
    assert done["meta_info"]["weight_versions"] == [
        {"version": "3", "start": 0, "end": 2},
        {"version": "4", "start": 2, "end": 5},
    ]
    assert done["meta_info"]["weight_version"] == "4" and "weight_version_spans" not in done["meta_info"]
    assert parse_generate(done, "e").spans() == [VersionSpan(0, 3), VersionSpan(2, 4)]
    # as in SGLang: a streamed chunk before the end has no spans and reports the engine's current version
    chunk = embedded_answer(3, [(0, "3"), (2, "4")], None)["meta_info"]
    assert "weight_versions" not in chunk and chunk["weight_version"] == "5"
    # aborted while waiting: no output, one empty span of the current version
    aborted = embedded_answer(0, [], {"type": "abort", "message": "x"})["meta_info"]
    assert aborted["weight_versions"] == [{"version": "5", "start": 0, "end": 0}] and aborted["weight_version"] == "5"


# ------------------------------------------------------------------ the client uses only the declared API
def test_the_client_sends_and_reads_only_the_declared_keys(monkeypatch):
    calls, reads, exercised = record_client(monkeypatch)
    public = {n for n, f in inspect.getmembers(HttpEngine, inspect.iscoroutinefunction) if not n.startswith("_")}
    assert public - {"aclose"} == exercised, "a new HttpEngine call: make it in record_client, declare it in sglang_api"

    # requests: every endpoint the client calls is declared, with no body key beyond the declared ones
    sent: dict[tuple[str, str], set[str] | None] = {}
    for method, path, body in calls:
        if body is None:
            sent.setdefault((method, path), None)
        else:
            sent[(method, path)] = (sent.get((method, path)) or set()) | set(body)
    generate = sent.pop(("POST", "/generate"))
    assert generate == set(api.GENERATE_REQUEST)
    sampling = set().union(*(set(b["sampling_params"]) for _, p, b in calls if p == "/generate"))
    assert sampling == set(api.SAMPLING_PARAMS)
    assert sent == {k: (None if v is None else set(v)) for k, v in api.CONTROL.items()}
    assert {b["mode"] for _, p, b in calls if p == "/pause_generation"} == set(api.PAUSE_MODES)

    # responses: the client looked at exactly the declared keys
    by_path: dict[str, set[str]] = {}
    for path, key in reads:
        by_path.setdefault(path, set()).add(key)
    assert by_path.pop("") == set(api.GENERATE_RESPONSE)
    assert by_path.pop("meta_info") == set(api.META_INFO)
    assert by_path.pop("meta_info.finish_reason") == set(api.FINISH_REASON)
    assert by_path.pop("meta_info.weight_versions[]") == set(api.WEIGHT_VERSION_SPAN)
    assert by_path.pop("/update_weights_from_disk") == set(api.UPDATE_WEIGHTS_REPLY)
    for path in api.SYNC_CALLS:
        assert by_path.pop(path) == set(api.UPDATE_WEIGHTS_REPLY), path
    assert by_path.pop("/model_info") == set(api.MODEL_INFO)
    assert by_path == {}, f"the client reads undeclared response keys: {by_path}"
