"""The documentation a user gets is the repository's: nothing points at files only the developers had, and every
link and file path the docs name exists in the checkout."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([
    r"DESIGN" + r"\.md",  # the design notes
    r"\.\./" + r"shared\b",  # the folder beside the checkout they live in
    r"/work/" + r"shared\b",
    r"\breference/" + r"[\w.-]+\.md",  # protocol notes
]))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A repository path in backticks: a top-level folder, then a file name with an extension.
TOP = ("pipeline", "actors", "tests", "benchmarks", "configs", "harness_images", "docs")
CODE_PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[\w./-]*\.\w+)`")
NOT_FILES = {
    "configs/NAME.toml",  # a placeholder: --experiment NAME
    "tests/test.sh",  # inside a task folder (the Harbor format)
}


def tracked() -> list[str]:
    """The repository's files: git's list, or (an unpacked source tree) every file outside hidden and build
    folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {"runs", "node_modules", "__pycache__", "build", "dist"}
        return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()
                and not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                            for part in p.relative_to(ROOT).parts)]


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *(ROOT / p for p in tracked() if p.endswith("README.md") and p != "README.md")]


def test_nothing_points_outside_the_repository():
    bad = []
    for rel in tracked():
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary fixtures; a file deleted in the work tree
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "these name files users do not have; point at README.md or docs/ instead:\n" + "\n".join(bad)


def test_every_relative_link_in_the_docs_resolves():
    files = set(tracked())
    bad = []
    for doc in docs():
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else None
            if rel is None or not (rel in files or any(f.startswith(rel + "/") for f in files)):
                bad.append(f"{doc.relative_to(ROOT)}: ({target})")
    assert not bad, "links to files that are not in the repository:\n" + "\n".join(bad)


def test_every_repository_path_the_docs_name_exists():
    files = set(tracked())
    bad = [f"{doc.relative_to(ROOT)}: `{p}`" for doc in docs() for p in CODE_PATH.findall(doc.read_text("utf-8"))
           if p not in NOT_FILES and p.rstrip("/") not in files and not any(f.startswith(p.rstrip("/") + "/") for f in files)]
    assert not bad, "paths the docs name that are not in the repository:\n" + "\n".join(bad)


def test_readme_stays_a_users_page():
    # The README says what bridle is, how to run and extend it; histories go to benchmarks/, internals to docs/.
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 350, f"README.md has {lines} lines (at most 350): move details into docs/"


TOML_BLOCK = re.compile(r"```toml\n(.*?)```", re.DOTALL)
# What the snippets name on a user's machine, here: a task folder and an event log (the recorded fixture, unpacked).
PLACEHOLDERS = {"/data/tasks": str(ROOT / "tests" / "data" / "harbor"), "/data/teacher-eval/events.msgpack": ""}


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_every_toml_snippet_in_the_docs_validates(monkeypatch, tmp_path):
    """A snippet with [run] or [experiment] is a whole experiment file; any other is a fragment of one, laid over
    configs/quickstart.toml. Either way it must load as written (only the task folder's path is substituted, and
    the judge's key variable set)."""
    import tomllib

    from actors import REGISTRY
    from pipeline.core import config as cfg
    from pipeline.core.runtime import make_resolver

    monkeypatch.setenv("JUDGE_API_KEY", "set-by-the-test")
    import gzip
    import shutil

    log = tmp_path / "events.msgpack"
    with gzip.open(ROOT / "tests" / "data" / "quickstart.events.msgpack.gz") as src, open(log, "wb") as dst:
        shutil.copyfileobj(src, dst)
    here = {**PLACEHOLDERS, "/data/teacher-eval/events.msgpack": str(log)}
    resolve = make_resolver(REGISTRY)
    quickstart = tomllib.loads((ROOT / "configs" / "quickstart.toml").read_text(encoding="utf-8"))
    checked = 0
    for doc in docs():
        for block in TOML_BLOCK.findall(doc.read_text(encoding="utf-8")):
            for placeholder, path in here.items():
                block = block.replace(placeholder, path)
            raw = tomllib.loads(block)
            whole = "run" in raw or "experiment" in raw
            try:
                cfg.load_experiment(raw if whole else _merge(quickstart, raw), resolve)
            except cfg.ConfigError as e:
                raise AssertionError(f"{doc.relative_to(ROOT)}: a TOML snippet does not validate: {e}\n{block}") from e
            checked += 1
    assert checked >= 4
