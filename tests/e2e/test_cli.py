"""run.py as a user runs it: a real subprocess, real files, real signals."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "run.py")]

EXP = """
[experiment]
name = "live"
[graph]
actors = {{ source = "actors.toy:Source", scale = "actors.toy:Scale", sink = "actors.toy:Sink" }}
edges = ["source.out -> scale", "scale.out -> sink"]
queue_size = 4
[source]
count = -1
interval_s = 0.02
[scale]
factor = {factor}
mode = "{mode}"
[sink]
path = "{sink}"
"""


def start(tmp_path, factor=2.0, mode="mul"):
    exp = tmp_path / "live.toml"
    sink = tmp_path / "sink.jsonl"
    exp.write_text(EXP.format(factor=factor, mode=mode, sink=sink))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        RUN + ["--experiment", str(exp), "--run-dir", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return proc, exp, sink, run_dir


def wait_for(pred, timeout=30.0, what="condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def sink_rows(sink):
    if not sink.exists():
        return []
    return [json.loads(line) for line in sink.read_text().splitlines() if line.strip()]


def test_help_explains_the_flags():
    out = subprocess.run(RUN + ["--help"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    for flag in ("--experiment", "--set", "--replay", "--run-dir", "--json", "--stage"):
        assert flag in out
    assert "configs/NAME.toml" in out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_running_graph_quickly_with_the_log_intact(tmp_path, signum):
    """Ctrl-C, and SIGTERM (what a job scheduler or `docker stop` sends), stop the graph the same way."""
    proc, _exp, sink, run_dir = start(tmp_path)
    try:
        wait_for(lambda: len(sink_rows(sink)) >= 10, what="the graph to run")
        t0 = time.monotonic()
        proc.send_signal(signum)
        proc.wait(timeout=2.0)  # the acceptance bound: Ctrl-C ends the graph within 2 s
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    print(f"{signal.Signals(signum).name} -> exit in {elapsed:.3f} s")
    assert proc.returncode == 130
    replay = subprocess.run(RUN + ["--replay", str(run_dir / "events.msgpack"), "--json"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    s = json.loads(replay.stdout)
    assert s["truncated_at"] is None
    assert s["by_type"]["Note"] >= 2 * 10 - 1
    assert s["by_type"]["ActorStopped"] == 3
    log_lines = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["signal"] for r in log_lines if r["event"].startswith("signal received; stopping the graph")] == [
        signal.Signals(signum).name]
    assert (run_dir / "config.toml").exists()


def test_hot_reload_in_a_live_run_and_refusal_of_a_fixed_field(tmp_path):
    proc, exp, sink, run_dir = start(tmp_path, factor=2.0)
    try:
        wait_for(lambda: len(sink_rows(sink)) >= 5, what="first notes")
        exp.write_text(EXP.format(factor=7.0, mode="mul", sink=sink))
        wait_for(lambda: any(r["value"] == 7.0 * r["seq"] and r["seq"] > 0 for r in sink_rows(sink)),
                 what="the new factor to be used")
        # a fixed field: refused, and the reloadable change made in the same edit is not applied either
        exp.write_text(EXP.format(factor=11.0, mode="add", sink=sink))
        log = run_dir / "log.jsonl"
        wait_for(lambda: "config reload refused" in log.read_text(), what="the refusal")
        n = len(sink_rows(sink))
        wait_for(lambda: len(sink_rows(sink)) >= n + 10, what="more notes")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    rows = sink_rows(sink)
    factors = {r["value"] / r["seq"] for r in rows if r["seq"] > 0}
    assert factors == {2.0, 7.0}
    refusals = [json.loads(x) for x in log.read_text().splitlines() if "refused" in x]
    assert len(refusals) == 1 and "[scale].mode" in refusals[0]["reason"]
    s = json.loads(subprocess.run(RUN + ["--replay", str(run_dir), "--json"], capture_output=True, text=True,
                                  cwd=ROOT, check=True).stdout)
    assert s["by_type"]["ConfigChanged"] == 2  # one accepted, one refused; both are events


def test_bad_config_exits_2_with_a_clear_message(tmp_path):
    exp = tmp_path / "bad.toml"
    exp.write_text(EXP.format(factor='"big"', mode="mul", sink=tmp_path / "s"))
    r = subprocess.run(RUN + ["--experiment", str(exp)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 2
    assert "bad.toml: [scale].factor: expected float, got str" in r.stderr
    r = subprocess.run(RUN + ["--experiment", "toy", "--set", "source.count=x"], capture_output=True, text=True,
                       cwd=ROOT, check=False)
    assert r.returncode == 2 and "--set source.count=x" in r.stderr
    # a missing task folder: one line naming the file, the field and what to give instead, no traceback
    r = subprocess.run(RUN + ["--experiment", "quickstart", "--validate", "--set", 'scheduler.tasks.tasks="/no/such"'],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    expected = (f"error: {ROOT / 'configs' / 'quickstart.toml'}: [scheduler].tasks: task folder '/no/such' does not "
                "exist (give a folder of Harbor task folders, or builtin:FAMILY)")
    assert r.stderr.strip().splitlines() == [expected], r.stderr


def test_run_then_replay_summary_and_stage(tmp_path):
    sink = tmp_path / "sink.jsonl"
    run_dir = tmp_path / "run"
    subprocess.run(RUN + ["--experiment", "toy", "--run-dir", str(run_dir), "--no-watch",
                          "--set", f'sink.path="{sink}"', "--set", "source.interval_s=0"],
                   capture_output=True, text=True, cwd=ROOT, check=True)
    assert len(sink_rows(sink)) == 20
    text = subprocess.run(RUN + ["--replay", str(run_dir / "events.msgpack")], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout
    assert "Note 40" in text and "events     43" in text
    sink2 = tmp_path / "sink2.jsonl"
    r = subprocess.run(RUN + ["--replay", str(run_dir / "events.msgpack"), "--stage", "scale,sink",
                              "--set", f'sink.path="{sink2}"', "--run-dir", str(tmp_path / "replay")],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(r.stdout.strip().splitlines()[-1])["run_dir"] == str(tmp_path / "replay")
    assert sink_rows(sink2) == sink_rows(sink)
    runs = tmp_path / "runs"  # where a replay without --run-dir makes its folder
    r = subprocess.run(RUN + ["--replay", str(run_dir / "events.msgpack"), "--stage", "nope",
                              "--set", f'experiment.runs_dir="{runs}"'],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 2 and "--stage nope: not an actor of the recorded graph" in r.stderr
    assert not runs.exists()  # refused before the run folder is made


@pytest.mark.parametrize("args", [[], ["--experiment"]])
def test_usage_errors(args):
    r = subprocess.run(RUN + args, capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 2


SHORT = [  # the quickstart cut to seconds: a small model, 8 demonstrations, one RL step of 2 groups of 2
    "experiment.build_model.tasks=20", "scheduler.sft_groups=8", "tree.sft_pack=4", "learner.sft_epochs=1",
    "run.steps=1", "run.groups_per_step=2", "scheduler.group_size=2", "scheduler.tasks.count=10",
    'monitor.display="off"', "eval.tasks.count=3", "eval.samples=2",
]


@pytest.mark.slow
def test_every_help_example_runs(tmp_path):
    """Each example `python run.py --help` prints runs as printed: runs shortened with --set, the rest as is."""
    sys.path.insert(0, str(ROOT))
    from run import EXAMPLES
    from tests.helpers.ci import require
    from tests.helpers.docker import docker_available

    run_dir = tmp_path / "run"
    short = [a for s in [*SHORT, f'run.model="{tmp_path / "model"}"'] for a in ("--set", s)]

    def sub(cmd: str) -> list[str]:
        args = cmd.split()[2:]  # drop "python run.py"
        names = {"RUN_DIR": run_dir, "LOG": run_dir / "events.msgpack", "EVAL_A": tmp_path / "eval-a",
                 "EVAL_B": tmp_path / "eval-b"}
        return [str(names[a]) if a in names else a for a in args]

    def call(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(RUN + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)

    def check(cmd: str) -> None:
        args = sub(cmd)
        if args == ["--experiment", "quickstart"]:
            r = call(args + ["--run-dir", str(run_dir), "--no-watch", *short])
        elif args[0] == "--experiment" and "--validate" not in args:
            r = call(args + ["--validate"])  # the same file and overrides as a full run would read
        elif args[0] == "--serve":
            proc = subprocess.Popen(RUN + args + ["--run-dir", str(tmp_path / "serve")], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            line = proc.stdout.readline()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            assert "openai_base_url" in json.loads(line), line
            return
        elif args[0] == "--eval":  # the first evaluates RUN_DIR's policy (EVAL_A), the second the base (EVAL_B)
            out = tmp_path / ("eval-a" if "--checkpoint" in args else "eval-b")
            r = call(args + ["--run-dir", str(out), *short])
            assert r.returncode == 0 and "| overall | all |" in r.stdout, r.stderr[-3000:]
        elif args[0] == "--build-images":
            require(docker_available(), "no Docker engine for --build-images")
            r = call(args, timeout=1800)
        elif "--stage" in args:
            r = call(args + ["--run-dir", str(tmp_path / f"replay-{args[-1]}")])
        else:
            r = call(args)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"

    # The first run makes RUN_DIR, and --resume appends to its log, so both go first and alone; --compare reads
    # both evaluations, so it goes last; the rest only read RUN_DIR and run side by side (each is mostly a Python
    # start-up waiting on imports).
    first = [next(c for c, _ in EXAMPLES if sub(c) == ["--experiment", "quickstart"]),
             next(c for c, _ in EXAMPLES if sub(c)[0] == "--resume")]
    last = [c for c, _ in EXAMPLES if sub(c)[0] == "--compare"]
    middle = [c for c, _ in EXAMPLES if c not in first and c not in last]
    for cmd in first:
        check(cmd)
    with ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(check, middle))  # re-raises the first failure
    for cmd in last:
        check(cmd)
    assert {*first, *middle, *last} == {c for c, _ in EXAMPLES}


def _processes_mentioning(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd:
                out.append(int(d.name))
    return out


def _quickstart(tmp_path, *sets: str) -> subprocess.Popen:
    args = RUN + ["--experiment", "quickstart", "--run-dir", str(tmp_path / "run"), "--no-watch",
                  "--set", f'run.model="{tmp_path / "model"}"', "--set", 'monitor.display="off"']
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


@pytest.mark.slow
def test_ctrl_c_while_the_model_is_being_built_stops_at_once(tmp_path):
    """The signal handler is up before the model build, and the build thread is abandoned, not joined: before, the
    signal was lost until the build finished."""
    proc = _quickstart(tmp_path, "experiment.build_model.tasks=20000")
    try:
        wait_for(lambda: (tmp_path / "run" / "log.jsonl").exists()
                 and "preparing the model" in (tmp_path / "run" / "log.jsonl").read_text(), what="the model build")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert not (tmp_path / "model" / "model.safetensors").exists()  # it really stopped before the build ended


@pytest.mark.slow
@pytest.mark.parametrize(("second", "backend"), [
    pytest.param(signal.SIGINT, "local", id="SIGINT-local"),
    pytest.param(signal.SIGTERM, "docker", id="SIGTERM-docker", marks=pytest.mark.docker),
])
def test_a_second_signal_exits_at_once_without_a_traceback_or_leftovers(tmp_path, second, backend):
    """Ctrl-C twice, or Ctrl-C then a job scheduler's SIGTERM: the emergency stop removes the harnesses, processes
    on the local backend, containers on Docker."""
    if backend == "docker":
        from tests.helpers.docker import require_images
        require_images()
    proc = _quickstart(tmp_path, "experiment.build_model.tasks=20", "scheduler.sft_groups=0", "run.steps=50",
                       "scheduler.tasks.count=10", f'sandbox.backend="{backend}"')
    from pipeline.core.eventlog import EventLogReader
    from pipeline.core.runfiles import marked_pids, run_tag
    from pipeline.rollout.sandbox.local import MARKER_RUN
    from tests.helpers.leftovers import leftovers_of

    metrics = tmp_path / "run" / "metrics.jsonl"
    marker = f"{MARKER_RUN}={run_tag(tmp_path / 'run')}".encode()
    try:
        wait_for(lambda: metrics.exists() and '"source": "sandbox"' in metrics.read_text(), timeout=300,
                 what="rollouts")
        if backend == "docker":
            from tests.helpers.docker import containers_of
            wait_for(lambda: containers_of(run_tag(tmp_path / "run"), running_only=True), timeout=120,
                     what="a harness container running")
        else:
            wait_for(lambda: marked_pids(marker), timeout=60, what="a harness running")
        # The second signal follows closely: given time, the graceful stop the first one began would clean up
        # the harnesses itself, and the emergency stop would go untested (it takes ~2 s). Not too closely: two
        # SIGINTs sent before the process took the first are one signal (standard signals do not queue).
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        proc.send_signal(second)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    at = err.find("Traceback")
    assert at < 0, err[max(0, at - 1500): at + 3000]  # the traceback itself, not the log's last lines
    assert "second signal" in err, err[-3000:]
    assert list(EventLogReader(tmp_path / "run" / "events.msgpack"))  # readable: a cut tail at most
    # Checked at once: the emergency stops ran before the exit. Harnesses run in sessions of their own, in
    # workspaces in the temp dir; they are found by their environment marker (BRIDLE_SANDBOX_RUN=<run tag>).
    left = leftovers_of(tmp_path / "run")
    left.pop("engine_ports", None)  # in the run folder; the next start of the run replaces it
    assert left == {}
    time.sleep(1.0)
    assert _processes_mentioning(str(tmp_path / "model")) == []  # the engine is gone
