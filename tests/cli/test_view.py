"""run.py --view: the static site of a run, read back as a person would see it, from real recorded logs; and what a
hostile policy or sandbox wrote is shown as text, never run."""

import gzip
import html
import json
import os
import re
import shutil
from pathlib import Path

import msgspec

from pipeline.cli.view import page_name, write_site
from pipeline.core.eventlog import EventLogWriter, LogHeader
from pipeline.messages import (
    SCHEMA_VERSION,
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    pack_f32,
    pack_i32,
)
from pipeline.tokens.render import load_renderer

DATA = Path(__file__).resolve().parents[1] / "data"


def rows_of(index: Path) -> list[dict]:
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', index.read_text(), re.DOTALL)
    return json.loads(m.group(1))


def visible(page: Path) -> str:
    body = page.read_text().split("</style>", 1)[1]
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def test_a_recorded_quickstart_reads_rollout_by_rollout(tmp_path):
    log = tmp_path / "events.msgpack"
    with gzip.open(DATA / "quickstart.events.msgpack.gz") as src, open(log, "wb") as dst:
        shutil.copyfileobj(src, dst)
    index = write_site(log, tmp_path / "site")
    rows = rows_of(index)
    pages = sorted(p.name for p in (tmp_path / "site" / "rollouts").iterdir())
    assert len(rows) == len(pages) == 28 and sorted(r["page"] for r in rows) == pages
    train = [r for r in rows if r["purpose"] == "train"]
    assert train and all(r["status"] == "ok" and r["trainable"] == r["sampled"] > 0 for r in train)
    text = visible(tmp_path / "site" / "rollouts" / train[0]["page"])
    assert "Create file" in text  # the task's instruction, decoded from the request's token ids
    assert "chain 0: #0 (first, main, trained)" in text and "call #0 · main · first · trained" in text
    page = (tmp_path / "site" / "rollouts" / train[0]["page"]).read_text()
    assert page.count('class="t tr" title=') == train[0]["trainable"]  # one span per trained output token
    lps = [float(x) for x in re.findall(r'title="id \d+ · logprob (-?\d+\.\d{3}) · v\d+"', page)]
    assert len(lps) == train[0]["sampled"] and all(-30 < x <= 0 for x in lps)  # the sampled tokens' logprobs
    assert "n/a (0 steps)" in index.read_text()  # a log without metrics.jsonl beside it: no curve, said so


def test_hostile_text_and_ids_stay_text(tmp_path):
    r = load_renderer("qwen3")
    evil = "</pre><script>alert(1)</script><img src=x onerror=alert(2)>"
    out = r.tokenizer.encode(evil + "<|im_end|>")
    rid = "../../evil</script>"
    req = RolloutRequest(rollout_id=rid, group_id="g00003", index=0, group_size=1, task_id=evil, harness="codex",
                         token="t", policy_version=1)
    call = ModelCall(rollout_id=rid, call_id="c", seq=0, protocol="chat",
                     input_ids=pack_i32(r.tokenizer.encode(f"<|im_start|>user\n{evil}<|im_end|>\n")),
                     output_ids=pack_i32(out), logprobs=pack_f32([-0.5] * len(out)))
    fin = RolloutFinished(rollout_id=rid, group_id="g00003", status="ok", reward=0.0, details=evil)
    log = tmp_path / "run" / "events.msgpack"
    log.parent.mkdir()
    (log.parent / "config.toml").write_text("[run]\ngroups_per_step = 2\n")
    header = LogHeader(schema_version=SCHEMA_VERSION, run_id="r", created=0.0, experiment="t", config={})
    with EventLogWriter(log, header) as w:
        w.append("collector.settled", SettledRollout(request=req, finished=fin, calls=[call]), t=0.0)
    index = write_site(log.parent)
    assert index == log.parent / "view" / "index.html"
    (row,) = rows_of(index)
    assert row["step"] == "2" and row["task"] == evil  # group 3 of 2 per step: step 2; the data keeps the text
    assert page_name(rid) == "_.._evil__script_.html"
    pages = list((log.parent / "view" / "rollouts").iterdir())
    assert [p.name for p in pages] == [page_name(rid)]
    for page in (index, pages[0]):
        raw = page.read_text()
        assert "<script>alert" not in raw and "<img src=x" not in raw
    assert evil in visible(pages[0])  # shown, as text
    assert "</script>" not in index.read_text().split('id="data">', 1)[1].split("</script>", 1)[0]


def test_the_workspace_a_run_kept_is_listed_without_following_links(tmp_path):
    from pipeline.core.runfiles import run_tag
    from pipeline.rollout.sandbox.util import rollout_dir_prefix

    run = tmp_path / "run"
    run.mkdir()
    work = tmp_path / "work"
    (run / "config.toml").write_text(f'[sandbox]\nkeep_workspaces = true\nworkdir = "{work}"\n')
    app = work / (rollout_dir_prefix(run_tag(run), "g00000-r0") + "x1y2") / "app"
    app.mkdir(parents=True)
    (app / "out.txt").write_text("cat")
    (app / "<img src=x onerror=alert(4)>.txt").write_text("<script>alert(3)</script>")
    (app / "passwd").symlink_to("/etc/passwd")
    deep = app.parent.with_name(rollout_dir_prefix(run_tag(run), "g00000-r1") + "z") / "app"
    deep.mkdir(parents=True)
    chain = deep
    for _ in range(1200):  # deeper than Python's recursion limit: the walk gives up, the page is still written
        chain = chain / "d"
        os.mkdir(chain)
    req = RolloutRequest(rollout_id="g00000-r0", group_id="g00000", index=0, group_size=1, task_id="t",
                         harness="codex", token="t", policy_version=0)
    fin = RolloutFinished(rollout_id="g00000-r0", group_id="g00000", status="ok", reward=1.0)
    call = ModelCall(rollout_id="g00000-r0", call_id="c", seq=0, protocol="chat", input_ids=pack_i32([1, 2]),
                     output_ids=pack_i32([3]), logprobs=pack_f32([-0.1]))
    header = LogHeader(schema_version=SCHEMA_VERSION, run_id="r", created=0.0, experiment="t", config={})
    with EventLogWriter(run / "events.msgpack", header) as w:
        for rid in ("g00000-r0", "g00000-r1"):
            r = msgspec.structs.replace
            w.append("collector.settled", SettledRollout(
                request=r(req, rollout_id=rid), finished=r(fin, rollout_id=rid),
                calls=[r(call, rollout_id=rid)]), t=0.0)
    try:
        write_site(run)
    finally:  # pytest's own clean-up of old temporary folders (shutil.rmtree) would hit the same RecursionError
        from pipeline.core.runfiles import remove_tree

        assert remove_tree(deep)
    assert "could not be listed: RecursionError" in visible(run / "view" / "rollouts" / "g00000-r1.html")
    page = run / "view" / "rollouts" / "g00000-r0.html"
    raw = page.read_text()
    assert "<script>alert(3)" not in raw and "<img src=x" not in raw
    text = visible(page)
    assert "Workspace kept" in text and "out.txt (3 bytes)cat" in text
    assert "passwd (link)" in text and "root:" not in text  # a planted link is named, never read
    assert "<img src=x onerror=alert(4)>.txt" in text and "<script>alert(3)</script>" in text  # as text
