"""Bring your own model: `run.py --serve` with a local model folder whose chat template renders history differently
from the last turn refuses to start with a readable report; template_check = "warn" serves it and logs the report.
The scripted engine plays its answers in that folder's own format, so a real call goes through too."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import openai

from tests.helpers.model_folders import broken_chatml, model_folder

ROOT = Path(__file__).resolve().parents[2]


def serve(tmp_path: Path, *sets: str) -> subprocess.Popen:
    folder = model_folder(tmp_path / "my-model", "chatml", broken_chatml())
    args = ["--set", f"proxy.engine.renderer={folder}", *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen([sys.executable, "run.py", "--serve", "--experiment", "serve", "--run-dir",
                             str(tmp_path / "run"), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_serve_refuses_a_mismatching_template(tmp_path):
    proc = serve(tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert out == ""  # no endpoints announced
    report = err[err.index("error: "):]
    assert "[proxy.engine].renderer" in report and "template_check = \"warn\"" in report
    assert "conversation 0 (agent: system, tools, calls, results, thinking): whole" in report
    assert "first difference at token" in report
    # token ids, tokens and text on both sides of the first difference
    assert "the template, whole   [" in report and "'<tool_call>'" in report
    assert "bridle, turn by turn  'Let me look." in report
    assert "Traceback" not in err


def test_serve_warn_starts_logs_the_report_and_serves(tmp_path):
    proc = serve(tmp_path, "proxy.template_check=warn")
    try:
        info = json.loads(proc.stdout.readline())
        with openai.OpenAI(base_url=info["openai_base_url"], api_key=info["token"], max_retries=0) as c:
            tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
            r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], tools=tools)
            assert r.choices[0].message.tool_calls[0].function.name == "write_file"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    (warn,) = [x for x in lines if x["event"].startswith("template check mismatch")]
    assert warn["level"] == "warning" and warn["mismatches"] == 1
    assert "first difference at token" in warn["event"]
