"""``run.py --view RUN_OR_LOG [--out DIR]``: a static site to read a run's rollouts, opened from disk with no server.

- ``index.html``: the run's curves (reward, pass rate, KL, entropy per RL step, from ``metrics.jsonl``) and a table
  of every rollout (step, group, task, harness, purpose, status and first reason, reward and its parts, calls,
  trainable and sampled tokens), filtered in the page by harness, status, purpose and step. The table's rows are
  data in the page; each rollout's page is its own file, loaded only when opened, so a run of thousands stays fast.
- ``rollouts/<id>.html``: the rollout's tree (chains, how each call joined: first, exact, retry, a named rewrite,
  branch, root; dead leaves; compactions), the workspace files the run kept (``[sandbox] keep_workspaces``), and
  each call: the request as the policy saw it, decoded turn by turn
  (the system prompt and all but the newest turns collapsed), the tool calls as the proxy parsed them, and the
  policy's output token by token, coloured by whether it was trained, with its log-probability and policy version
  on hover; then the verifier's verdict.

Any event log works: a training run's, an evaluation's, a ``--serve`` recording (rebuilt from its call records).
Everything a sandbox or the policy wrote is escaped: the page shows text, it never runs it.
"""

from __future__ import annotations

import html
import json
import re
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from pipeline.core.recordings import Recorded, recorded_rollouts
from pipeline.core.runfiles import run_tag
from pipeline.messages import floats, ids
from pipeline.monitor.metrics import load_metrics, of_kind
from pipeline.rollout.sandbox.util import rollout_dir_prefix
from pipeline.rollout.untrusted import UntrustedFileError, read_under, walk_files
from pipeline.tokens.render import Renderer, load_renderer
from pipeline.trees.filters import how_attached
from pipeline.trees.tree import RolloutTree, TreeOptions, build_tree

CURVES = ("reward", "pass_rate", "kl", "entropy")
OPEN_TURNS = 2  # the newest turns of a request shown open; earlier ones (and the system prompt) collapsed
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f4f4f4}
.curves{display:flex;gap:1.5em;flex-wrap:wrap}.curve{border:1px solid #ddd;padding:.4em}.na{color:#999}
pre{white-space:pre-wrap;word-break:break-word;background:#fafafa;border:1px solid #eee;padding:.5em;margin:.3em 0}
.t{border-radius:2px}.tr{background:#d8f5d0}.nt{background:#eee;color:#777}.call{border-left:3px solid #bbb;
padding-left:.8em;margin:1.2em 0}.status-ok{color:#176f2c}.status-bad{color:#b3261e}summary{cursor:pointer}
.filters label{margin-right:1em}
"""


def site_source(path: Path) -> tuple[Path, Path | None]:
    """(event log, run folder or None) of a run folder or a log path."""
    if path.is_dir():
        return path / "events.msgpack", path
    return path, path.parent if (path.parent / "config.toml").is_file() else None


def _config(run_dir: Path | None) -> dict[str, Any]:
    p = run_dir / "config.toml" if run_dir else None
    return tomllib.loads(p.read_text(encoding="utf-8")) if p and p.is_file() else {}


def _renderer(config: dict[str, Any]) -> Renderer:
    name = config.get("proxy", {}).get("engine", {}).get("renderer", "qwen3")
    return load_renderer(name)


KEPT_FILES = 60  # files listed per kept workspace
KEPT_TEXT = 4096  # bytes of a small file shown inline


def kept_workspace(config: dict[str, Any], run_dir: Path | None, rollout_id: str) -> Path | None:
    """The folder the run kept for this rollout (``[sandbox] keep_workspaces``), if it is still there."""
    sandbox = config.get("sandbox", {})
    if run_dir is None or not sandbox.get("keep_workspaces"):
        return None
    bases = [sandbox.get("ray", {}).get("workspaces", ""), sandbox.get("workdir", "")]
    prefix = rollout_dir_prefix(run_tag(run_dir), rollout_id)
    for base in (Path(b) for b in bases if b):
        found = sorted(base.glob(prefix + "*")) if base.is_dir() else []
        if found:
            return found[0]
    found = sorted(Path(tempfile.gettempdir()).glob(prefix + "*"))
    return found[0] if found else None


def _workspace_html(folder: Path | None) -> str:
    """The kept workspace's files (never following links: a policy may plant them), small text files inline."""
    if folder is None:
        return ""
    app = folder / "app"
    try:
        entries = walk_files(app) if app.is_dir() else []
    except (OSError, RecursionError) as e:  # a policy's folder chain thousands deep
        return (f"<h2>Workspace kept</h2><p><code>{html.escape(str(folder))}</code></p>"
                f"<p class=\"na\">its files could not be listed: {html.escape(type(e).__name__)}</p>")
    items = []
    for rel, st in entries[:KEPT_FILES]:
        text = ""
        if stat.S_ISREG(st.st_mode) and st.st_size <= KEPT_TEXT:
            try:
                text = f"<pre>{html.escape(read_under(app, rel, KEPT_TEXT).decode('utf-8', 'replace'))}</pre>"
            except (OSError, UntrustedFileError):
                text = ""
        kind = "link" if stat.S_ISLNK(st.st_mode) else f"{st.st_size:,} bytes"
        items.append(f"<details><summary><code>{html.escape(rel)}</code> ({kind})</summary>{text}</details>")
    more = f"<p>… {len(entries) - KEPT_FILES} more</p>" if len(entries) > KEPT_FILES else ""
    return (f"<h2>Workspace kept</h2><p><code>{html.escape(str(folder))}</code></p>"
            + ("".join(items) or "<p class=\"na\">no files</p>") + more)


def _step(req: Any, groups_per_step: int) -> str:
    """The RL step a rollout was issued for ("sft", "eval <n>", or "" when unknown)."""
    if req.purpose == "sft":
        return "sft"
    if req.purpose == "eval":
        return f"eval {req.eval.step}" if req.eval is not None and req.eval.step >= 0 else "eval"
    m = re.match(r"g(\d+)", req.group_id)
    return str(int(m.group(1)) // groups_per_step + 1) if m and groups_per_step else ""


def _svg(values: list[tuple[int, float]], name: str) -> str:
    if not values:
        return f'<div class="curve"><b>{name}</b><div class="na">n/a (0 steps)</div></div>'
    w, h = 260, 90
    xs = [x for x, _ in values]
    ys = [y for _, y in values]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (w - 10) / (x1 - x0 or 1)
    sy = (h - 10) / (y1 - y0 or 1)
    pts = " ".join(f"{5 + (x - x0) * sx:.1f},{h - 5 - (y - y0) * sy:.1f}" for x, y in values)
    return (f'<div class="curve"><b>{name}</b> <span class="na">steps {x0}-{x1}, {y0:.3g} to {y1:.3g}</span><br>'
            f'<svg width="{w}" height="{h}"><polyline fill="none" stroke="#1f5fbf" stroke-width="1.5" '
            f'points="{pts}"/></svg></div>')


def page_name(rollout_id: str) -> str:
    """A rollout's page file name: its id, with anything but letters, digits, ".", "_" and "-" replaced."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", rollout_id).lstrip(".") + ".html"


def _row(rec: Recorded, tree: RolloutTree | None, groups_per_step: int) -> dict[str, Any]:
    s = rec.rollout
    req, fin = s.request, s.finished
    st = tree.stats if tree is not None else None
    trains = st is not None and req.purpose != "eval"  # evaluation rollouts are never trained
    return {
        "id": req.rollout_id, "page": page_name(req.rollout_id), "step": _step(req, groups_per_step), "group": req.group_id, "task": req.task_id,
        "harness": req.harness, "purpose": req.purpose,
        "status": fin.status if rec.verified else "no verdict", "reason": fin.details[:160],
        "reward": round(fin.reward, 4) if rec.verified else None,
        "parts": {k: round(v, 4) for k, v in fin.rewards.items()}, "calls": len(s.calls),
        "trainable": st.tokens_trainable if trains else 0, "sampled": st.tokens_output if st else 0,
    }


def _json_script(data: Any) -> str:
    return json.dumps(data).replace("<", "\\u003c")  # no "</script>" can end the block early


def index_page(name: str, rows: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> str:
    rl = of_kind(metrics, "rl_step")
    curves = "".join(_svg([(int(m["step"]), float(m[c])) for m in rl if isinstance(m.get(c), (int, float))], c)
                     for c in CURVES)
    opts = {k: sorted({r[k] for r in rows}) for k in ("harness", "status", "purpose")}
    selects = "".join(
        f'<label>{k} <select id="f-{k}"><option value="">all</option>'
        + "".join(f"<option>{html.escape(v)}</option>" for v in vals) + "</select></label>"
        for k, vals in opts.items())
    return f"""<!doctype html><meta charset="utf-8"><title>{html.escape(name)}</title><style>{STYLE}</style>
<h1>{html.escape(name)}</h1>
<div class="curves">{curves}</div>
<h2>Rollouts <span id="count"></span></h2>
<div class="filters">{selects}<label>step <input id="f-step" size="6" placeholder="e.g. 3, sft"></label></div>
<table><thead><tr><th>step</th><th>group</th><th>task</th><th>harness</th><th>purpose</th><th>status</th>
<th>reason</th><th>reward</th><th>parts</th><th>calls</th><th>trainable / sampled</th></tr></thead>
<tbody id="rows"></tbody></table>
<script type="application/json" id="data">{_json_script(rows)}</script>
<script>
const rows = JSON.parse(document.getElementById("data").textContent);
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({{"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}})[c]);
function draw() {{
  const f = k => document.getElementById("f-" + k).value.trim();
  const shown = rows.filter(r => ["harness", "status", "purpose"].every(k => !f(k) || r[k] === f(k))
                            && (!f("step") || r.step === f("step")));
  document.getElementById("count").textContent = `(${{shown.length}} of ${{rows.length}})`;
  document.getElementById("rows").innerHTML = shown.map(r => `<tr><td>${{esc(r.step)}}</td><td>${{esc(r.group)}}</td>
    <td>${{esc(r.task)}}</td><td>${{esc(r.harness)}}</td><td>${{esc(r.purpose)}}</td>
    <td class="${{r.status === "ok" ? "status-ok" : "status-bad"}}">${{esc(r.status)}}</td><td>${{esc(r.reason)}}</td>
    <td>${{r.reward === null ? "n/a" : r.reward}}</td><td>${{esc(Object.entries(r.parts).map(([k, v]) => k + " " + v).join(", "))}}</td>
    <td>${{r.calls}}</td><td><a href="rollouts/${{encodeURIComponent(r.page)}}">${{r.trainable}} / ${{r.sampled}}</a></td></tr>`).join("");
}}
document.querySelectorAll("select, input").forEach(e => e.addEventListener("input", draw));
draw();
</script>
"""


def _turns(text: str) -> list[tuple[str, str]]:
    """(role, content) of each ChatML turn of a decoded prompt (the generation prompt's empty turn dropped)."""
    out = []
    for part in text.split("<|im_start|>")[1:]:
        role, _, body = part.partition("\n")
        body = body.removesuffix("\n").removesuffix("<|im_end|>")
        if body or role != "assistant":
            out.append((role, body))
    return out or [("text", text)]


def _request_html(renderer: Renderer, input_ids: Any) -> str:
    turns = _turns(renderer.tokenizer.decode(list(input_ids)))
    parts = []
    for i, (role, body) in enumerate(turns):
        open_ = role != "system" and i >= len(turns) - OPEN_TURNS
        parts.append(f"<details{' open' if open_ else ''}><summary>{html.escape(role)} ({len(body):,} chars)"
                     f"</summary><pre>{html.escape(body)}</pre></details>")
    return "".join(parts)


def _output_html(renderer: Renderer, call: Any, trained: bool) -> str:
    out, lps = ids(call.output_ids), floats(call.logprobs)
    spans = sorted((v.start, v.version) for v in call.versions)
    cls = "tr" if trained else "nt"
    toks = []
    for i, tok in enumerate(out.tolist()):
        version = next((ver for start, ver in reversed(spans) if start <= i), None)
        tip = f"id {tok} · logprob {float(lps[i]):.3f}" + (f" · v{version}" if version is not None else "")
        toks.append(f'<span class="t {cls}" title="{html.escape(tip)}">'
                    f"{html.escape(renderer.tokenizer.decode([tok]))}</span>")
    return "<pre>" + "".join(toks) + "</pre>"


def rollout_page(rec: Recorded, tree: RolloutTree | None, renderer: Renderer, name: str,
                 workspace: Path | None = None) -> str:
    s = rec.rollout
    req, fin = s.request, s.finished
    calls = sorted(s.calls, key=lambda c: c.seq)
    infos = {c.call_id: (n, c) for n, c in enumerate(tree.calls)} if tree is not None else {}
    trains = req.purpose != "eval"  # evaluation rollouts are measured, never trained (the tree builder skips them)
    head = (f"<p><b>task</b> {html.escape(req.task_id)} · <b>harness</b> {html.escape(req.harness)} · "
            f"<b>purpose</b> {req.purpose} · <b>group</b> {html.escape(req.group_id)}</p>")
    verdict = (f"<p><b>status</b> <span class=\"{'status-ok' if fin.status == 'ok' else 'status-bad'}\">"
               f"{fin.status}</span> · <b>reward</b> {fin.reward:g} "
               + "".join(f"· {html.escape(k)} {v:g} " for k, v in fin.rewards.items())
               + f"</p><pre>{html.escape(fin.details)}</pre>" if rec.verified
               else "<p class=\"na\">no verdict in this log (a --serve recording, or a run cut before it)</p>")
    tree_html = ""
    if tree is not None:
        items = []
        for k, chain in enumerate(tree.chains):
            seqs = []
            for n in chain.calls:
                info = tree.calls[n]
                kind = how_attached(tree.calls, tree.chains, n)
                notes = [kind, info.label]
                if info.leaf and not info.kept:
                    notes.append("dead leaf")
                if info.summary_for >= 0:
                    notes.append(f"compaction → chain {info.summary_for}")
                notes.append("trained" if trains and info.kept_tokens and info.included else "not trained")
                seqs.append(f'<a href="#call{info.seq}">#{info.seq}</a> ({html.escape(", ".join(notes))})')
            items.append(f"<li>chain {k}: {' → '.join(seqs)}</li>")
        invalid = f"<p class=\"status-bad\">not trained: {html.escape(tree.invalid)}</p>" if tree.invalid else ""
        tree_html = f"<h2>Tree</h2>{invalid}<ul>{''.join(items)}</ul>"
    body = []
    for c in calls:
        n, info = infos.get(c.call_id, (None, None))
        trained = bool(trains and info is not None and info.kept_tokens and info.included)
        attach = how_attached(tree.calls, tree.chains, n) if tree is not None and n is not None else "?"
        uses = ""
        if c.trace is not None:
            uses = (f"<p><b>output</b> {c.trace.output}"
                    + "".join(f"<br>tool call <code>{html.escape(u.name)}</code> "
                              f"<code>{html.escape(json.dumps(u.args, ensure_ascii=False))}</code>"
                              for u in c.trace.uses)
                    + "".join(f"<br>tool result <code>{html.escape(o.name)}</code>{' (error)' if o.error else ''}"
                              for o in c.trace.outcomes) + "</p>")
        body.append(
            f'<div class="call" id="call{c.seq}"><h3>call #{c.seq} · {c.label} · {html.escape(attach)} · '
            f'{"trained" if trained else "not trained"} · {len(ids(c.input_ids)):,} in, '
            f"{len(ids(c.output_ids)):,} out · {c.finish_reason}</h3>"
            f"<details><summary>request</summary>{_request_html(renderer, ids(c.input_ids))}</details>"
            f"{uses}<b>output</b>{_output_html(renderer, c, trained)}</div>")
    failed = "".join(f"<li>call #{f.seq}: {html.escape(f.reason)}</li>" for f in s.failed_calls)
    title = html.escape(f"{name} · {req.rollout_id}")
    return (f'<!doctype html><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style>'
            f'<p><a href="../index.html">← {html.escape(name)}</a></p><h1>{html.escape(req.rollout_id)}</h1>'
            f"{head}<h2>Verdict</h2>{verdict}{tree_html}{_workspace_html(workspace)}"
            + (f"<h2>Failed calls</h2><ul>{failed}</ul>" if failed else "")
            + "<h2>Calls</h2><p>Output tokens: <span class=\"t tr\">trained</span> "
              "<span class=\"t nt\">not trained</span>; hover for the log-probability and policy version.</p>"
            + "".join(body))


def write_site(source: Path, out: Path | None = None) -> Path:
    """Write the site for ``source`` (a run folder or an event log) into ``out`` (default: ``<run>/view``, or
    ``<log>.view``); returns the index page's path."""
    log, run_dir = site_source(source)
    if not log.is_file():
        raise FileNotFoundError(f"{log}: no event log (give a run folder or its events.msgpack)")
    out = out or (run_dir / "view" if run_dir else log.with_suffix(".view"))
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    config = _config(run_dir)
    renderer = _renderer(config)
    groups_per_step = int(config.get("run", {}).get("groups_per_step", 0))
    name = run_dir.name if run_dir else log.stem
    metrics = load_metrics(run_dir / "metrics.jsonl") if run_dir and (run_dir / "metrics.jsonl").is_file() else []
    rows = []
    for rec in recorded_rollouts(log):
        try:
            tree = build_tree(rec.rollout, TreeOptions())
        except ValueError:
            tree = None
        rows.append(_row(rec, tree, groups_per_step))
        page = out / "rollouts" / page_name(rec.rollout.request.rollout_id)
        workspace = kept_workspace(config, run_dir, rec.rollout.request.rollout_id)
        page.write_text(rollout_page(rec, tree, renderer, name, workspace), encoding="utf-8")
    index = out / "index.html"
    index.write_text(index_page(name, rows, metrics), encoding="utf-8")
    return index
