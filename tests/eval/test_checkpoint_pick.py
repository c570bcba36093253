"""``--eval --checkpoint RUN_DIR`` picks the newest complete weights folder, and says so when the run's log holds a
newer policy that no folder has (pushed without the disk, the run stopped before its final write)."""

import json

import structlog

from pipeline.cli.evaluate import latest_weights
from pipeline.core.eventlog import SCHEMA_VERSION, EventLogWriter, LogHeader
from pipeline.messages import PolicyUpdated
from pipeline.training.learner import WEIGHTS_INFO_FILE


def _run_dir(tmp_path, folders: list[int], logged: list[int]):
    (tmp_path / "config.toml").write_text('[learner]\nweight_sync = "distributed"\n')
    for v in folders:
        d = tmp_path / "weights" / f"v{v:05d}"
        d.mkdir(parents=True)
        (d / WEIGHTS_INFO_FILE).write_text(json.dumps({"version": v}))
    (tmp_path / "weights" / "v00099").mkdir()  # a folder being written: no info file, never picked
    with EventLogWriter(tmp_path / "events.msgpack", LogHeader(schema_version=SCHEMA_VERSION, run_id="r", created=0.0,
                                                                    experiment="t", config={})) as w:
        for step, v in enumerate(logged):
            w.append("learner.updates", PolicyUpdated(version=v, step=step, pushed=True), t=float(step))
    return tmp_path


def test_the_newest_complete_folder_is_picked_quietly_when_it_is_the_last_policy(tmp_path):
    with structlog.testing.capture_logs() as lines:
        assert latest_weights(_run_dir(tmp_path, [1, 3], [1, 2, 3])).name == "v00003"
    assert not [x for x in lines if x["log_level"] == "warning"]


def test_a_newer_policy_only_in_the_log_is_warned_about(tmp_path):
    with structlog.testing.capture_logs() as lines:
        assert latest_weights(_run_dir(tmp_path, [1], [1, 2, 3])).name == "v00001"
    (w,) = [x for x in lines if x["log_level"] == "warning"]
    assert (w["logged_version"], w["logged_step"], w["evaluated_version"]) == (3, 2, 1)
    assert "no weights folder" in w["event"]


def test_a_run_that_wrote_every_policy_to_disk_is_not_read_for_it(tmp_path):
    """weight_sync = "disk" gives every policy a folder: the log (possibly gigabytes) is not scanned, so even a log
    claiming a newer version draws no warning."""
    run = _run_dir(tmp_path, [1], [1, 2, 3])
    (run / "config.toml").write_text('[learner]\nweight_sync = "disk"\n')
    with structlog.testing.capture_logs() as lines:
        assert latest_weights(run).name == "v00001"
    assert not [x for x in lines if x["log_level"] == "warning"]
