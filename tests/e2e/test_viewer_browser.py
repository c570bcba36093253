"""The trajectory viewer in a real headless browser (Chromium from the OS packages): the site of a real Codex
recording (tests/data/codex.events.msgpack.gz: rollouts of a training run through Codex 0.171.0 in Docker, cut from
its event log, with one evaluation rollout of the same policy, whose tokens are not trained) renders with its
script run, and screenshots are kept (``$BRIDLE_ARTIFACTS``, default the test's folder)."""

import gzip
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.cli.view import write_site

DATA = Path(__file__).resolve().parents[1] / "data"
pytestmark = pytest.mark.slow


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (harness_images/ci_setup.sh installs it)")
        pytest.skip("chromium is not installed")
    return found


def browse(binary: str, page: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                           *extra, page.as_uri()], capture_output=True, text=True, timeout=120, check=False)


def test_the_site_of_a_codex_recording_renders_in_a_browser(tmp_path):
    binary = chromium()
    log = tmp_path / "events.msgpack"
    with gzip.open(DATA / "codex.events.msgpack.gz") as src, open(log, "wb") as dst:
        shutil.copyfileobj(src, dst)
    index = write_site(log, tmp_path / "site")
    shots = Path(os.environ.get("BRIDLE_ARTIFACTS", tmp_path)) / "viewer"
    shots.mkdir(parents=True, exist_ok=True)

    dom = browse(binary, index, "--dump-dom").stdout
    body = re.search(r'<tbody id="rows">(.*?)</tbody>', dom, re.DOTALL).group(1)
    rows = re.findall(r"<tr>", body)  # drawn by the page's script from its data
    pages = sorted((tmp_path / "site" / "rollouts").iterdir())
    assert len(rows) == len(pages) >= 5, dom[-2000:]
    assert re.search(r'\((\d+) of \1\)', dom)  # the count the script wrote: every row shown, no filter
    assert "codex" in dom and "status-ok" in dom
    evaluated_row = re.search(r"<tr><td>eval</td>.*?</tr>", body, re.DOTALL).group(0)
    assert re.search(r">0 / [1-9]\d*</a>", evaluated_row)  # sampled tokens, none trainable

    train = next(p for p in pages if p.name.startswith("g"))
    evaluated = next(p for p in pages if p.name.startswith("eval"))
    for page in (train, evaluated):
        dom = browse(binary, page, "--dump-dom").stdout
        assert "harness</b> codex" in dom and "You are a coding agent running in the Codex CLI" in dom
        assert "chain 0: " in dom  # the tree, chain by chain
    assert 'class="t tr"' in browse(binary, train, "--dump-dom").stdout  # trained output tokens
    eval_dom = browse(binary, evaluated, "--dump-dom").stdout
    assert 'class="t nt"' in eval_dom and 'class="t tr" title' not in eval_dom  # an evaluation trains nothing

    for name, page in (("run", index), ("rollout", train)):
        shot = shots / f"{name}.png"
        r = browse(binary, page, f"--screenshot={shot}", "--window-size=1400,1000")
        assert shot.is_file() and shot.stat().st_size > 10_000, r.stderr[-2000:]
