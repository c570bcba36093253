"""Generated task families: reproducible, valid Harbor folders, oracle scores 1 and an untouched workspace 0."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rollout.taskgen import FAMILIES, generate, generate_to, resolve_families
from pipeline.rollout.taskgen.__main__ import main as cli_main
from pipeline.rollout.taskgen.text_processing import _VOCAB
from pipeline.rollout.tasks import Task, load_task, materialize, seed_workspace
from pipeline.rollout.verify import replay_actions_local, run_solution_local, run_verifier_local

SEEDS_PER_FAMILY = 8  # each seed runs the real verifier three times; the slow test covers many more


@pytest.fixture(autouse=True)
def fast_python3(monkeypatch):
    # Task scripts call `python3`; put this interpreter first so a slow shim (pyenv) does not dominate test time.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


async def _scores(task: Task, tmp: Path) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for mode in ("untouched", "solve.sh", "actions"):
        ws = seed_workspace(task, tmp / task.id / mode)
        if mode == "solve.sh":
            r = await run_solution_local(task, ws)
            assert r.exit_code == 0, (task.id, r.output_tail)
        elif mode == "actions":
            await replay_actions_local(task.oracle_actions or [], ws)
        v = await run_verifier_local(task, ws)
        out[mode] = v.reward if v.status == "ok" else f"{v.status}: {v.error}"
    return out


def _check_families(tmp_path: Path, seeds: range) -> None:
    tasks = generate_to(tmp_path / "tasks", "all", len(seeds), seeds.start)
    results: dict[str, dict] = {}

    async def main():
        limiter = anyio.CapacityLimiter(4)

        async def one(t: Task):
            async with limiter:
                results[t.id] = await _scores(t, tmp_path / "ws")

        async with anyio.create_task_group() as tg:
            for t in tasks:
                tg.start_soon(one, t)

    anyio.run(main)
    bad = {k: v for k, v in results.items() if v != {"untouched": 0.0, "solve.sh": 1.0, "actions": 1.0}}
    assert not bad, bad
    assert {t.family for t in tasks} == set(FAMILIES) and len(results) == len(FAMILIES) * len(seeds)


@pytest.mark.slow
def test_every_family_oracle_1_untouched_0(tmp_path):
    _check_families(tmp_path, range(SEEDS_PER_FAMILY))


@pytest.mark.slow
def test_every_family_oracle_1_untouched_0_many_seeds(tmp_path):
    _check_families(tmp_path, range(100, 130))


def test_at_least_five_families_with_metadata():
    assert len(FAMILIES) >= 5
    for name, mod in FAMILIES.items():
        spec = generate(name, 0)
        md = spec.config.metadata
        assert md["family"] == name and md["difficulty"] == mod.DIFFICULTY and md["seed"] == 0
        assert spec.id == f"{name}-0"
        for a in json.loads(spec.solution["actions.json"]):
            assert a["tool"] in {"write_file", "read_file", "edit_file", "bash"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reproducible_and_varied(family):
    assert msgspec.json.encode(generate(family, 7)) == msgspec.json.encode(generate(family, 7))
    distinct = {
        msgspec.json.encode([generate(family, s).instruction, generate(family, s).workspace])
        for s in range(30)
    }
    assert len(distinct) >= 25


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(FAMILIES)), st.integers(0, 10**9))
def test_any_seed_generates_a_valid_task(tmp_path_factory, family, seed):
    t = materialize(generate(family, seed), tmp_path_factory.mktemp("t") / "task")
    assert load_task(t.root).oracle_actions == t.oracle_actions and t.oracle_actions
    expected = json.loads((t.tests_dir / "expected.json").read_text())
    assert expected["checks"]
    assert sorted(p.name for p in t.tests_dir.iterdir()) == ["check.py", "expected.json", "test.sh"]
    for c in expected["checks"]:
        if c["kind"] == "calls":  # as many held-out calls as the visible tests make
            visible = (t.workspace_seed / f"test_{c['module']}.py").read_text().count("    def test_")
            assert len(c["cases"]) == 2 * visible


def test_create_file_is_one_short_write():
    for s in range(50):
        spec = generate("create_file", s)
        actions = json.loads(spec.solution["actions.json"])
        assert len(actions) == 1 and actions[0]["tool"] == "write_file"
        assert len(spec.instruction) <= 60 and not spec.workspace
        assert (
            actions[0]["args"]["content"] in spec.instruction
            and actions[0]["args"]["path"] in spec.instruction
        )


def test_vocab_has_no_substring_words():
    assert not [(a, b) for a in _VOCAB for b in _VOCAB if a != b and a in b]


def test_resolve_families():
    assert resolve_families("all") == list(FAMILIES)
    assert resolve_families("bugfix, create_file") == ["bugfix", "create_file"]
    with pytest.raises(ValueError, match="unknown task family"):
        resolve_families("nope")
    with pytest.raises(ValueError, match="unknown task family"):
        generate("nope", 0)


def test_bugfix_hidden_tests_ignore_edited_visible_tests(tmp_path):
    t = materialize(generate("bugfix", 4), tmp_path / "t")
    ws = seed_workspace(t, tmp_path / "ws")
    mod = next(p for p in ws.glob("*.py") if not p.name.startswith("test_"))
    (ws / f"test_{mod.stem}.py").write_text("")  # deleting the visible tests does not help
    (ws / "unittest.py").write_text("raise SystemExit(0)\n")  # nor shadowing the standard library
    assert anyio.run(run_verifier_local, t, ws).reward == 0.0
    mod.write_text("import sys\nsys.exit(0)\n")  # nor exiting early from the module under test
    assert anyio.run(run_verifier_local, t, ws).reward == 0.0


def test_checker_reads_no_link(tmp_path):
    t = materialize(generate("create_file", 3), tmp_path / "t")
    action = t.oracle_actions[0].args
    ws = seed_workspace(t, tmp_path / "ws")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text(action["content"])  # the right content, but outside the workspace
    (ws / action["path"]).parent.mkdir(parents=True, exist_ok=True)
    (ws / action["path"]).symlink_to(elsewhere)
    r = anyio.run(run_verifier_local, t, ws)
    assert (r.status, r.reward) == ("ok", 0.0) and "symbolic link" in r.stdout_tail, r
    (ws / action["path"]).unlink()
    (ws / action["path"]).write_text(action["content"])
    assert anyio.run(run_verifier_local, t, ws).reward == 1.0



def test_checker_refuses_a_workspace_file_over_its_cap_unread(tmp_path):
    """A 16 MiB + 1 answer file (sparse: it costs no disk) is refused by size, before a byte of it is read."""
    from pipeline.rollout.taskgen.check_template import FILE_CAP

    t = materialize(generate("create_file", 3), tmp_path / "t")
    action = t.oracle_actions[0].args
    ws = seed_workspace(t, tmp_path / "ws")
    answer = ws / action["path"]
    answer.parent.mkdir(parents=True, exist_ok=True)
    with answer.open("wb") as f:
        f.write(b"CANARY-7f3a " + action["content"].encode())
        f.truncate(FILE_CAP + 1)
    r = anyio.run(run_verifier_local, t, ws)
    assert (r.status, r.reward) == ("ok", 0.0), r
    assert f"{FILE_CAP + 1} bytes, more than {FILE_CAP}" in r.stdout_tail and "CANARY" not in r.stdout_tail, r


def test_the_checkers_copy_for_workspace_code_stops_at_its_byte_cap(tmp_path):
    """The copy handed to workspace code (module checks) holds at most COPY_CAP bytes: a sparse file over the cap,
    which would cost its full size copied, is left out; links are recreated, never followed; a FIFO is skipped."""
    import os

    from pipeline.rollout.taskgen.check_template import COPY_CAP, _copy_tree

    src, dst = tmp_path / "ws", tmp_path / "copy"
    (src / "pkg").mkdir(parents=True)
    dst.mkdir()
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    with (src / "huge.bin").open("wb") as f:
        f.truncate(COPY_CAP + 1)
    (src / "secret").symlink_to("/etc/hostname")
    os.mkfifo(src / "pipe")
    left = _copy_tree(str(src), str(dst), COPY_CAP)
    assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*")) == ["pkg", "pkg/mod.py", "secret"]
    assert (dst / "secret").is_symlink() and os.readlink(dst / "secret") == "/etc/hostname"
    assert left == COPY_CAP - len("X = 1\n")
    # the budget is spent across files: what no longer fits is left out, what fits still goes in
    (src / "huge.bin").unlink()
    for name, size in (("a", 40), ("b", 40), ("c", 10)):
        (src / name).write_bytes(b"x" * size)
    dst2 = tmp_path / "copy2"
    dst2.mkdir()
    _copy_tree(str(src), str(dst2), 60)
    kept = {p.name for p in dst2.iterdir() if p.is_file() and not p.is_symlink()}
    assert "c" in kept and len(kept & {"a", "b"}) == 1, kept

PROBE = """
import json, os
seen = {"uid": os.getuid(), "env": sorted(os.environ), "cwd": os.getcwd()}
try:
    open(os.path.join(TESTS, "expected.json")).read()
    seen["tests"] = "readable"
except OSError as e:
    seen["tests"] = type(e).__name__
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    seen["fork"] = "ok"
except OSError as e:
    seen["fork"] = type(e).__name__
with open(OUT, "w") as f:
    json.dump(seen, f)
"""


def test_checker_child_is_confined(tmp_path):
    """What workspace code sees when the bugfix checker imports it: no BRIDLE_* variable, a private copy of the
    workspace as its folder, no fork; as root also another uid and no access to tests/."""
    # In a folder every user may enter (pytest's own is root's only): the task (its tests/ are 0700) and a
    # world-writable drop box for the probe's report.
    shared = Path(tempfile.mkdtemp(prefix="bridle-test-"))
    try:
        shared.chmod(0o755)
        t = materialize(generate("bugfix", 2), shared / "t")
        ws = seed_workspace(t, tmp_path / "ws")
        out = shared / "drop" / "seen.json"
        out.parent.mkdir(mode=0o777)
        out.parent.chmod(0o777)
        mod = next(p for p in ws.glob("*.py") if not p.name.startswith("test_"))
        mod.write_text(f"TESTS = {str(t.tests_dir)!r}\nOUT = {str(out)!r}\n" + PROBE + mod.read_text())
        r = anyio.run(run_verifier_local, t, ws)
        assert (r.status, r.reward) == ("ok", 0.0), r
        seen = json.loads(out.read_text())
    finally:
        shutil.rmtree(shared)
    assert seen["fork"] != "ok" and seen["env"] == ["LANG", "PATH"] and seen["cwd"] != str(ws), seen
    if os.geteuid() == 0:
        assert seen["uid"] == 65534 and seen["tests"] == "PermissionError", seen


def test_cli_generates_and_checks(tmp_path, capsys):
    assert (
        cli_main(
            [
                "--family",
                "create_file,config_edit",
                "--n",
                "2",
                "--seed",
                "5",
                "--out",
                str(tmp_path),
                "--check",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "wrote 4 tasks" in out and "checked 4 tasks: 0 problems" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config_edit-5",
        "config_edit-6",
        "create_file-5",
        "create_file-6",
    ]
    assert cli_main(["--list"]) == 0
    assert "bugfix" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["--family", "nope", "--out", str(tmp_path / "x")])
