"""bridle against SGLang's own source (the pinned release's wheel, downloaded once and cached, never installed).

What the client really sends (every public HttpEngine call made against a recording server) must fit SGLang's
request structures: ``/generate`` bodies pass SGLang's own JSON contract gate (the generated decoder its HTTP server
runs on every body) and the ``GenerateReqInput`` fields; control bodies fit the request classes their FastAPI
handlers parse. What the client reads (:mod:`pipeline.serving.sglang_api`, which test_sglang_api.py proves is all
it reads) must be produced by SGLang's server and named by its response contract. The weight-version spans are
checked by running SGLang's own span code (``sglang/srt/utils/weight_versions.py``) on weight updates at every
token index and reading the result with the client; the embedded engine's answers and accepted parameters must
fit the same contracts. No wheel (offline): skipped on a laptop, a failure in CI.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.serving import sglang_api as api
from pipeline.serving.embedded import server as embedded_server
from pipeline.serving.launch import sglang_command
from pipeline.serving.sglang_api import write_weight_versions
from pipeline.serving.sglang_client import parse_generate
from tests.helpers.ci import require
from tests.helpers.sglang_record import embedded_answer, record_client
from tests.helpers.sglang_source import (
    Source,
    accepts,
    body_class,
    dict_keys,
    fetch_wheel,
    field_annotations,
    fields,
    find_class,
    find_function,
    keys_set_on,
    required_fields,
    routes,
)

IO = "srt/managers/io_struct.py"
HTTP = "srt/entrypoints/http_server.py"
CONTRACT = "api/v1/api_types.py"
TOKENIZER = "srt/managers/tokenizer_manager.py"
SPANS = "srt/utils/weight_versions.py"


@pytest.fixture(scope="module")
def sglang() -> Source:
    got = fetch_wheel()
    require(isinstance(got, Path), f"SGLang {api.SGLANG_VERSION}'s wheel is needed to check bridle against it: {got}")
    return Source(got)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def contract(sglang: Source) -> types.ModuleType:
    """SGLang's generated JSON contract (it imports only msgspec and typing)."""
    return sglang.module(CONTRACT)


@pytest.fixture(scope="module")
def client_calls() -> list[tuple[str, str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        calls, _, _ = record_client(mp)
    return calls


def test_the_wheel_is_the_pinned_release(sglang):
    assert sglang.version() == api.SGLANG_VERSION


def test_generate_bodies_pass_sglangs_contract(sglang, contract, client_calls):
    handler = routes(sglang.tree(HTTP))[("POST", "/generate")]
    assert body_class(handler) == "GenerateReqInput"
    # the handler refuses a body its generated contract decoder refuses (sampling_params: unknown keys -> 400)
    assert any(isinstance(n, ast.Name) and n.id == "generate_contract_error" for n in ast.walk(handler))
    assert "GenerateRequest.from_json_value(body)" in sglang.text("srt/entrypoints/api_contract.py")
    py_request = fields(sglang.tree(IO), "GenerateReqInput")
    bodies = [b for _, p, b in client_calls if p == "/generate"]
    assert bodies
    for body in bodies:
        decoded = contract.GenerateRequest.from_json_value(body)
        assert decoded.return_logprob is True and decoded.stream is False and decoded.input_ids == body["input_ids"]
        sp = decoded.sampling_params
        assert (sp.top_k, sp.no_stop_trim, sp.skip_special_tokens) == (body["sampling_params"]["top_k"], True, False)
        assert set(body) <= py_request
    assert py_request & fields(sglang.tree(CONTRACT), "GenerateRequest") >= api.GENERATE_REQUEST
    py_sampling = fields(sglang.tree("srt/sampling/sampling_params.py"), "SamplingParams")
    assert py_sampling & fields(sglang.tree(CONTRACT), "SamplingParams") >= api.SAMPLING_PARAMS
    with pytest.raises(contract.JsonContractError, match="unknown field `bogus`"):  # the check has teeth
        contract.GenerateRequest.from_json_value({**bodies[0], "sampling_params": {"bogus": 1}})


def test_control_bodies_fit_sglangs_request_classes(sglang, client_calls):
    io, handlers = sglang.tree(IO), routes(sglang.tree(HTTP))
    for method, path, body in client_calls:
        assert (method, path) in handlers, f"SGLang {api.SGLANG_VERSION} has no {method} {path}"
        if path == "/generate" or body is None:
            continue
        cls = body_class(handlers[(method, path)])
        annotations = field_annotations(io, cls)
        assert set(body) <= set(annotations), f"{path}: {set(body) - set(annotations)} are not fields of {cls}"
        assert required_fields(io, cls) <= set(body), f"{path}: {cls} needs {required_fields(io, cls)}"
        for key, value in body.items():
            assert accepts(annotations[key], value) is not False, f"{path}: {key}={value!r} is not {annotations[key]}"
    for (method, path), keys in api.CONTROL.items():
        assert (method, path) in handlers
        if keys:
            assert keys <= fields(io, body_class(handlers[(method, path)]))
    mode = field_annotations(io, "PauseGenerationReqInput")["mode"]
    assert {m for m in api.PAUSE_MODES if accepts(mode, m)} == api.PAUSE_MODES
    assert dict_keys(handlers[("POST", "/update_weights_from_disk")]) >= api.UPDATE_WEIGHTS_REPLY
    for path in api.SYNC_CALLS:
        assert dict_keys(handlers[("POST", path)]) >= api.UPDATE_WEIGHTS_REPLY, path
    assert dict_keys(handlers[("GET", "/model_info")]) >= api.MODEL_INFO


def test_sglang_answers_what_the_client_reads(sglang):
    contract_tree, tm, wv = sglang.tree(CONTRACT), sglang.tree(TOKENIZER), sglang.tree(SPANS)
    # the JSON contract (shared by SGLang's Python and Rust servers) names every key the client reads
    assert fields(contract_tree, "GenerateResponse") >= api.GENERATE_RESPONSE
    assert fields(contract_tree, "GenerateMetaInfo") >= api.META_INFO
    assert "matched" in fields(contract_tree, "FinishStop")
    assert list(field_annotations(contract_tree, "LogprobEntry")) == ["logprob", "token_id", "text"]
    # ... and the Python server produces them
    answers = [{k.value for k in d.keys if isinstance(k, ast.Constant)}
               for d in ast.walk(find_function(tm, "_handle_batch_output")) if isinstance(d, ast.Dict)]
    assert any(keys >= api.GENERATE_RESPONSE for keys in answers)
    assert all(keys >= api.GENERATE_RESPONSE for keys in answers if "output_ids" in keys)
    assert keys_set_on(tm, "meta_info") | keys_set_on(wv, "meta_info") >= api.META_INFO
    adds = [n for n in ast.walk(tm)
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "add_weight_versions_to_meta_info"]
    assert len(adds) >= 2  # finished answers and aborted ones
    entry = find_function(tm, "detokenize_logprob_tokens").body[0].body[0].value.elt  # type: ignore[attr-defined]
    assert ast.unparse(entry) == "(logprob, token_id, None)"
    matched = find_class(sglang.tree("srt/managers/schedule_batch.py"), "FINISH_MATCHED_TOKEN")
    assert dict_keys(matched) >= api.FINISH_REASON
    kinds = {v.value for f in ast.walk(sglang.tree("srt/managers/schedule_batch.py"))
             if isinstance(f, ast.FunctionDef) and f.name == "to_json"
             for d in ast.walk(f) if isinstance(d, ast.Dict)
             for k, v in zip(d.keys, d.values, strict=True)
             if isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant)}
    assert kinds == api.FINISH_TYPES  # the client refuses an unknown finish type


def test_the_span_structure_is_sglangs(sglang, contract):
    assert fields(sglang.tree(CONTRACT), "WeightVersionSpan") == api.WEIGHT_VERSION_SPAN
    add = find_function(sglang.tree(SPANS), "add_weight_versions_to_meta_info")
    [value] = [n.value for n in ast.walk(add) if isinstance(n, ast.Assign)
               and ast.unparse(n.targets[0]) == "meta_info['weight_versions']"]
    assert isinstance(value, ast.ListComp) and dict_keys(value.elt) == api.WEIGHT_VERSION_SPAN
    meta = contract.GenerateMetaInfo.from_json_value({"weight_versions": [{"version": "3", "start": 0, "end": 2}]})
    assert meta.weight_versions == [contract.WeightVersionSpan(version="3", start=0, end=2)]


# ------------------------------------------------------------------------ span semantics, by SGLang's own code
@pytest.fixture(scope="module")
def span_code(sglang: Source) -> types.ModuleType:
    # its only sglang import serves pydantic schemas, which the functions called here never touch
    imported = {a.name for n in sglang.tree(SPANS).body if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("sglang") for a in n.names}
    assert imported == {"msgspec_struct_pydantic_core_schema"}, imported
    return sglang.module(SPANS, drop_sglang_imports=True)


def sglang_meta(wv: types.ModuleType, updates: list[tuple[int, str]], n: int, seen: int) -> dict[str, Any]:
    """meta_info of a request with ``n`` output tokens whose weights changed from "0" to ``version`` when it had
    ``k`` tokens, for each ``(k, version)``, as the scheduler records it and the tokenizer manager reports it
    after ``seen`` tokens reached it (fewer than ``n`` for an abort)."""
    req = types.SimpleNamespace(output_ids=[], weight_version_events=[])
    current = "0"
    for k, version in updates:
        req.output_ids = [0] * k
        wv.record_weight_version_events([req], old_version=current)
        current = version
    spans = wv.compute_weight_version_spans(req.weight_version_events, current_version=current, num_output_tokens=n)
    meta: dict[str, Any] = {}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=seen)
    return meta


def expected_spans(updates: list[tuple[int, str]], seen: int) -> list[tuple[int, str]]:
    """Token i was sampled by the version the last update made before the output had i + 1 tokens."""
    out: list[tuple[int, str]] = []
    for i in range(seen):
        version = next((v for k, v in reversed(updates) if k <= i), "0")
        if not out or out[-1][1] != version:
            out.append((i, version))
    return out


def check_scenario(wv: types.ModuleType, updates: list[tuple[int, str]], n: int, seen: int) -> list[tuple[int, str]]:
    meta = sglang_meta(wv, updates, n, seen)
    answer = {"output_ids": list(range(seen)), "meta_info": {
        **meta, "id": "r", "finish_reason": {"type": "abort" if seen < n else "length"},
        "output_token_logprobs": [[-1.0, i, None] for i in range(seen)]}}
    res = parse_generate(answer, "r")
    assert res.version_spans == expected_spans(updates, seen), meta
    if seen == n:  # the embedded engine writes what SGLang writes
        current = updates[-1][1] if updates else "0"
        assert write_weight_versions(res.version_spans, n, current) == meta["weight_versions"]
    return res.version_spans


@pytest.mark.parametrize(
    ("updates", "n", "seen", "spans"),
    [
        ([], 4, 4, [(0, "0")]),
        ([(2, "1")], 5, 5, [(0, "0"), (2, "1")]),
        ([(1, "1"), (3, "2")], 4, 4, [(0, "0"), (1, "1"), (3, "2")]),
        ([(0, "1")], 3, 3, [(0, "1")]),  # before the first token
        ([(3, "1")], 3, 3, [(0, "0")]),  # after the last one
        ([(2, "1"), (2, "2")], 4, 4, [(0, "0"), (2, "2")]),  # version 1 sampled nothing
        ([(0, "1")], 0, 0, []),  # no output
        ([(3, "1")], 5, 2, [(0, "0")]),  # aborted with 2 of 5 tokens delivered
    ],
)
def test_spans_from_sglangs_code_read_exactly(span_code, updates, n, seen, spans):
    assert check_scenario(span_code, updates, n, seen) == spans


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_spans_from_sglangs_code_read_exactly_anywhere(span_code, data):
    n = data.draw(st.integers(0, 12))
    ks = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    check_scenario(span_code, [(k, str(i + 1)) for i, k in enumerate(ks)], n, data.draw(st.integers(0, n)))


# --------------------------------------------------------------------------------------- the embedded engine
def test_the_embedded_engine_fits_sglangs_contract(sglang, contract):
    produced = keys_set_on(sglang.tree(TOKENIZER), "meta_info") | keys_set_on(sglang.tree(SPANS), "meta_info")
    for answer in (embedded_answer(5, [(0, "3"), (2, "4")], {"type": "stop", "matched": 14}),
                   embedded_answer(2, [(0, "3")], None),
                   embedded_answer(0, [], {"type": "abort", "message": "aborted by request"})):
        decoded = contract.GenerateResponse.from_json_value(answer)
        assert decoded.output_ids == answer["output_ids"]
        assert set(answer) <= fields(sglang.tree(CONTRACT), "GenerateResponse") | {"text"}
        assert set(answer["meta_info"]) <= produced, "the embedded engine invents meta_info keys SGLang never sends"
    done = contract.GenerateResponse.from_json_value(embedded_answer(5, [(0, "3"), (2, "4")], {"type": "length"}))
    assert [(s.version, s.start, s.end) for s in done.meta_info.weight_versions] == [("3", 0, 2), ("4", 2, 5)]
    # every sampling parameter it accepts is SGLang's, and every endpoint it serves is SGLang's
    accepted = embedded_server._SUPPORTED | set(embedded_server._NEUTRAL)
    assert accepted <= fields(sglang.tree(CONTRACT), "SamplingParams")
    app = embedded_server.EngineServer(None, None, "").app()  # type: ignore[arg-type]
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert served <= set(routes(sglang.tree(HTTP))), served - set(routes(sglang.tree(HTTP)))


def test_the_launch_flags_are_sglangs(sglang):
    cmd = sglang_command("/m", host="127.0.0.1", port=30000, weight_version="0", mem_fraction_static=0.7)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "sglang/launch_server.py" in sglang.names
    assert 'return "--" + name.replace("_", "-")' in sglang.text("srt/arg_groups/arg_utils.py")
    options = set()
    for name in sorted(sglang.names):
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for node in ast.walk(sglang.tree(name.removeprefix("sglang/"))):
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                        and isinstance(node.annotation, ast.Subscript) and ast.unparse(node.annotation.value) == "A"):
                    options.add("--" + node.target.id.replace("_", "-"))
    flags = {a for a in cmd if a.startswith("--")}
    assert flags <= options, flags - options
