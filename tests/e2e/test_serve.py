"""`run.py --serve`: engine + proxy for recording a harness by hand; the log lists the calls."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]


def test_serve_records_calls_and_replay_lists_them(tmp_path):
    run_dir = tmp_path / "serve"
    proc = subprocess.Popen([sys.executable, "run.py", "--serve", "--experiment", "serve", "--run-dir", str(run_dir)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert {"openai_base_url", "anthropic_base_url", "token", "run_dir"} <= set(info)
        assert info["run_dir"] == str(run_dir)
        with openai.OpenAI(base_url=info["openai_base_url"], api_key=info["token"], max_retries=0) as c:
            tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}]
            msgs = [{"role": "user", "content": "write hello.txt"}]
            r = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == "write_file"
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
            r2 = c.chat.completions.create(model="policy", messages=msgs, tools=tools)
            assert r2.choices[0].message.content == "I wrote hello.txt."
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    out = subprocess.run([sys.executable, "run.py", "--replay", str(run_dir / "events.msgpack"), "--calls"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    assert len(out) == 2
    assert "#0" in out[0] and "chat" in out[0] and "spliced 0" in out[0]
    assert "#1" in out[1] and "spliced 1" in out[1]
    # the tree of a recording made by hand: no SettledRollout in the log, built from the call records
    out = subprocess.run([sys.executable, "run.py", "--replay", str(run_dir / "events.msgpack"), "--trees"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "calls=2" in out and "attach exact=1 first=1" in out and "(from call records)" in out, out
    assert "harness unknown: rollouts=1 calls=2" in out
    rep = json.loads(subprocess.run([sys.executable, "run.py", "--replay", str(run_dir / "events.msgpack"), "--trees",
                                     "--json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    (row,) = rep["rollouts"]
    assert row["settled"] is False and row["stats"]["calls_by_fate"] == {"trained": 2}
    assert rep["harnesses"]["unknown"]["tokens_trainable"] == rep["harnesses"]["unknown"]["tokens_output"] > 0
