"""A log recorded before the stage packages, [run] and the frame checksums (schema 1, bridle as of 2026-12-01)
still replays with identical tree and batch hashes.

The fixture is the event log of the shortened quickstart (16 demonstrations in 2 packs, 2 RL steps of 2 groups of
3). Its policy is rebuilt from the recorded build spec (the build is deterministic), since the learner trains on
the model's compact ids.
"""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import GroupDropped, TreeGroup

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "quickstart-schema1.events.msgpack.gz"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def old_log(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema1")
    log = d / "events.msgpack"
    log.write_bytes(gzip.decompress(FIXTURE.read_bytes()))
    return log


def test_schema1_messages_are_upgraded_on_read(old_log):
    r = EventLogReader(old_log)
    assert r.version == 1 and r.header.schema_version == 1
    packs = [e.msg for e in r if isinstance(e.msg, (TreeGroup, GroupDropped)) and e.msg.purpose == "sft"]
    assert len(packs) == 2 and {p.packs for p in packs} == {2}  # from the recorded [learner].sft_packs


def replay(log: Path, stage: str, out: Path, *sets: str) -> dict:
    args = [sys.executable, "run.py", "--replay", str(log), "--stage", stage, "--run-dir", str(out)]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_trees_and_batches_replay_identically(old_log, tmp_path):
    from pipeline.models.quickstart import ModelSpec, ensure_model

    spec = EventLogReader(old_log).header.config["experiment"]["build_model"]
    model = tmp_path / "model"
    ensure_model(msgspec.convert({**spec, "path": str(model)}, ModelSpec))
    out = replay(old_log, "trees", tmp_path / "rt")
    assert out["trees"]["replayed"] == out["trees"]["recorded"] == out["trees"]["identical"] == 6
    out = replay(old_log, "learner", tmp_path / "rl", f'run.model="{model}"')
    assert out["batches"]["replayed"] == out["batches"]["recorded"] == out["batches"]["identical"] == 3
