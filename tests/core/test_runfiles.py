"""A run's files outside its run folder: named by the run, found and removed by the next start of the same run."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from actors.proxy import ProxyActor
from pipeline.core.runfiles import remove_prefixed, remove_tree, run_tag
from pipeline.core.runtime import ActorContext
from pipeline.serving.proxy import ProxySettings
from tests.helpers.ci import require
from tests.helpers.users import as_nobody


def test_run_tag_is_stable_per_folder_and_differs_between_folders(tmp_path, monkeypatch):
    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    assert run_tag(a) == run_tag(a) == run_tag(str(a))
    monkeypatch.chdir(tmp_path / ".")
    assert run_tag(Path("x/run")) == run_tag(a)  # a relative path names the same folder
    assert run_tag(a) != run_tag(b) and run_tag(a).startswith("run-")
    long = run_tag(tmp_path / ("n" * 200 + "/weird name_with:chars"))
    assert len(long) <= 33 and "_" not in long and ":" not in long and " " not in long
    assert run_tag(None) != run_tag(None)  # no folder: nothing to resume, nothing shared


def test_remove_prefixed_removes_exactly_the_prefixed_entries(tmp_path):
    (tmp_path / "bridle-a_1" / "deep").mkdir(parents=True)
    (tmp_path / "bridle-a_2").write_text("f")
    (tmp_path / "bridle-a-b_1").mkdir()  # another run whose name merely starts the same
    (tmp_path / "other").mkdir()
    gone = remove_prefixed(tmp_path, "bridle-a_")
    assert sorted(p.name for p in gone) == ["bridle-a_1", "bridle-a_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bridle-a-b_1", "other"]
    assert remove_prefixed(tmp_path / "missing", "x") == []


def test_a_restart_of_the_run_removes_the_proxy_socket_folder_a_crash_left(tmp_path):
    run = tmp_path / "run"
    crashed = ProxyActor("proxy", ProxySettings(), ActorContext(run_dir=run)).settings()
    other_actor = ProxyActor("proxy-2", ProxySettings(), ActorContext(run_dir=run)).settings()
    other_run = ProxyActor("proxy", ProxySettings(), ActorContext(run_dir=tmp_path / "run2")).settings()
    try:
        for s in (crashed, other_actor, other_run):
            Path(s.unix_socket).touch()  # a socket file the killed proxy left
            assert len(s.unix_socket.encode()) < 108
            assert Path(s.unix_socket).parent.parent == Path(tempfile.gettempdir())
        again = ProxyActor("proxy", ProxySettings(), ActorContext(run_dir=run)).settings()
        assert not Path(crashed.unix_socket).parent.exists()
        assert Path(again.unix_socket).parent.is_dir()
        assert Path(other_actor.unix_socket).exists() and Path(other_run.unix_socket).exists()
        assert run_tag(run) in os.path.basename(Path(again.unix_socket).parent)
    finally:
        for s in (crashed, other_actor, other_run):
            remove_prefixed(Path(s.unix_socket).parent.parent, Path(s.unix_socket).parent.name)
        remove_prefixed(tempfile.gettempdir(), f"bridle.sock-{run_tag(run)}_")


def test_remove_tree_removes_folders_the_policy_made_unwritable_or_unsearchable():
    """The sandbox user owns its workspace and can chmod it: a folder without write or search permission stops a
    plain ``rm -rf`` of its owner, so remove_tree's ``chmod -R u+rwx`` retry is what removes it."""
    require(os.geteuid() == 0, "acting as the sandbox's user (65534) needs root")
    base = Path(tempfile.mkdtemp(prefix="bridle-rmtree-"))
    try:
        os.chmod(base, 0o755)
        trees = [base / "control", base / "ws"]
        for t in trees:
            (t / "unwritable" / "deep").mkdir(parents=True)
            (t / "unwritable" / "deep" / "f").write_text("x")
            (t / "unsearchable" / "sub").mkdir(parents=True)
            (t / "unsearchable" / "sub" / "g").write_text("y")
        subprocess.run(["chown", "-R", "65534:65534", str(base)], check=True)
        for t in trees:
            os.chmod(t / "unwritable", 0o555)
            os.chmod(t / "unsearchable", 0o600)
        # control: the owner's own plain removal fails on both folders
        assert as_nobody(lambda: subprocess.run(["rm", "-rf", str(trees[0])], check=False).returncode == 0) is False
        assert (trees[0] / "unwritable" / "deep").exists() and (trees[0] / "unsearchable").exists()
        assert as_nobody(lambda: remove_tree(trees[1])) is True
        assert not os.path.lexists(trees[1])
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
