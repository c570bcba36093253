"""A Ray node's task cache (pipeline/rollout/sandbox/ray_backend.py): each task folder unpacked once, its use
marked, and folders unused for ``[sandbox.ray] task_cache_idle_s`` removed (no Ray needed: plain functions)."""

from __future__ import annotations

import os
import time

from pipeline.rollout.sandbox.ray_backend import _tar, _unpacked_task, prune_task_cache
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import materialize


def test_a_task_is_unpacked_once_and_folders_idle_too_long_go(tmp_path):
    task = materialize(generate("create_file", 0), tmp_path / "src" / "t0")
    archive = _tar(task.root, task.root.name)
    cache = tmp_path / "cache"
    got = _unpacked_task(archive, "abc", "t0", 3600, cache)
    assert got.root == cache / "abc" / "t0" and (got.root / "instruction.md").is_file()
    marker = got.root / "marker"
    marker.write_text("x")
    assert _unpacked_task(archive, "abc", "t0", 3600, cache).root == got.root and marker.exists()  # not again

    old = time.time() - 7200
    for name in ("stale", ".stale-half-unpacked"):  # a folder no rollout used for 2 h, one a killed task left
        (cache / name).mkdir()
        os.utime(cache / name, (old, old))
    os.utime(cache / "abc", (old, old))  # in use again now: its use is marked, so it stays
    _unpacked_task(archive, "abc", "t0", 3600, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["abc"]
    assert prune_task_cache(cache, 3600, keep=cache / "abc") == []
