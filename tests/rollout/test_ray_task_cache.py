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


def test_the_driver_keeps_at_most_archive_cache_task_archives(tmp_path, monkeypatch):
    """The driver's side: each task folder archived and put in Ray's object store once while it is recent; the
    least recently used dropped beyond ``archive_cache`` (put again when its task comes back)."""
    import anyio

    from pipeline.rollout.sandbox import DockerSettings, ray_backend
    from pipeline.rollout.sandbox.ray_backend import RayBackend, RaySettings

    puts: list[bytes] = []

    class FakeRay:  # the object store: a reference per put
        @staticmethod
        def put(data: bytes) -> int:
            puts.append(data)
            return len(puts)

    monkeypatch.setattr(ray_backend, "_ray", lambda: FakeRay)
    tasks = [materialize(generate("create_file", i), tmp_path / f"t{i}") for i in range(3)]
    backend = RayBackend(RaySettings(archive_cache=2), DockerSettings(), run_id="cache")

    async def archive(i: int) -> tuple[str, int]:
        return await backend._task_archive(tasks[i])

    first = anyio.run(archive, 0)
    assert anyio.run(archive, 1)[0] != first[0]
    assert anyio.run(archive, 0) == first and len(puts) == 2  # recent: the same reference, not put again
    anyio.run(archive, 2)  # over the cap: task 1, the least recently used, is dropped
    assert list(backend._tasks) == [tasks[0].root, tasks[2].root]
    again = anyio.run(archive, 1)
    assert again[0] != first[0] and len(puts) == 4 and list(backend._tasks) == [tasks[2].root, tasks[1].root]
