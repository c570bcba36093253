"""Faults during a real run: an engine 500, a harness killed mid-call (its client connection drops, its sandbox
reports the failure). The run continues, the affected rollouts carry their statuses, nothing else is lost."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import CallFailed, PolicyUpdated, RolloutFinished, RolloutRequest
from tests.helpers.cli import run_py

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_engine_500_and_killed_sandbox_do_not_stop_the_run(tmp_path):
    script = tmp_path / "script.json"
    # every training rollout: one write, then an answer; slow enough that calls are in flight when we kill one
    script.write_text(json.dumps({
        "default": [{"tool_calls": [{"name": "write_file", "arguments": {"path": "a.txt", "content": "x"}}]},
                    {"text": "Done."}],
        "latency_s": 2.0,
        "fail_calls": [2],
    }))
    model = tmp_path / "model"
    run_dir = tmp_path / "run"
    sets = [
        f'run.model="{model}"', "experiment.build_model.tasks=20",
        f'proxy.engine={{kind="scripted", script="{script}"}}',
        "scheduler.sft_groups=0", "run.steps=3",
        "scheduler.group_size=2", "run.groups_per_step=2",
        "scheduler.tasks.count=10", 'monitor.display="off"',
        "proxy.engine_retries=0",  # the injected 500 reaches the harness (one retry would hide it)
    ]
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    t0 = time.monotonic()
    first_seen: dict[tuple[int, str], float] = {}
    while killed is None and time.monotonic() - t0 < 300 and proc.poll() is None:
        out = subprocess.run(["pgrep", "-f", f"harness.py --config .* --workspace {Path('/tmp')}"],
                             capture_output=True, text=True, check=False).stdout.split()
        # The white-box harness opens one connection per model call. One that has stayed open for 0.3 s is well
        # inside a call (2 s of engine latency): the proxy holds the request and waits on the engine, so killing
        # the harness then drops a client connection mid-call. A fresher one may still be sending its request,
        # or already have its answer (then the proxy's last write can succeed and nothing is dropped).
        now = time.monotonic()
        for p in (int(x) for x in out):
            if not _descends_from(p, proc.pid):
                continue
            for inode in _sockets(p):
                if now - first_seen.setdefault((p, inode), now) >= 0.3:
                    killed = p
        if killed is not None:
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=600)
    assert killed is not None, "never saw a harness process to kill"
    assert proc.returncode == 0, err[-3000:]

    evs = list(EventLogReader(run_dir / "events.msgpack"))
    issued = {e.msg.rollout_id for e in evs if isinstance(e.msg, RolloutRequest) and e.src == "scheduler.requests"}
    finished = [e.msg for e in evs if isinstance(e.msg, RolloutFinished)]
    assert sorted(f.rollout_id for f in finished) == sorted(issued)  # every rollout accounted for, once
    statuses = [f.status for f in finished]
    assert statuses.count("harness_error") + statuses.count("sandbox_error") >= 1, statuses
    failed = [e.msg.reason for e in evs if isinstance(e.msg, CallFailed)]
    assert any("injected fault" in r for r in failed), failed
    assert any("client disconnected" in r for r in failed), failed
    assert [e.msg.step for e in evs if isinstance(e.msg, PolicyUpdated)] == [1, 2, 3]


def _sockets(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:"):
                out.add(link)
    except OSError:  # gone meanwhile
        pass
    return out


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def _engine_pids(marker: str) -> list[int]:
    """Processes whose command line runs bridle's embedded engine for the model folder ``marker``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(c.startswith("pipeline.serving.embedded") for c in cmd) and marker in cmd:
            out.append(int(d.name))
    return out


def test_a_dead_engine_fails_the_run_at_once_with_its_exit_code(tmp_path):
    """Before the watchdog, a dead engine was noticed only at the next weight push (3.8-15 s later) while the
    scheduler kept issuing rollouts; a run without pushes never noticed."""
    model = tmp_path / "model"
    sets = [f'run.model="{model}"', "experiment.build_model.tasks=20", "scheduler.sft_groups=0", "run.steps=50",
            "scheduler.group_size=2", "run.groups_per_step=2", "scheduler.tasks.count=10",
            'monitor.display="off"']
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(tmp_path / "run"),
            "--no-watch"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        t0 = time.monotonic()
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and '"source": "sandbox"' in metrics.read_text()):  # a rollout finished
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300, "the run did not start rolling out"
            time.sleep(0.2)
        pids = _engine_pids(str(model))
        assert pids, "no embedded engine process found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    # the watchdog's words, not a failed weight push: the proxy actor stopped the run with the engine's exit code
    from pipeline.messages import ActorStopped

    stops = [e.msg for e in EventLogReader(tmp_path / "run" / "events.msgpack") if isinstance(e.msg, ActorStopped)]
    crash = [s for s in stops if s.reason == "crashed"]
    assert [s.actor for s in crash] == ["proxy"] and "EngineDied" in crash[0].error, stops
    assert "exited with code -9" in crash[0].error


def test_a_dead_proxy_worker_fails_the_run_with_its_log_and_leaves_no_process(tmp_path):
    """``[proxy] workers = 2``: a worker killed mid-run stops the run at once, naming the worker, its exit code and
    its log; the other worker is stopped with it."""
    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=20", "scheduler.sft_groups=0",
            "run.steps=50", "scheduler.group_size=2", "run.groups_per_step=2", "scheduler.tasks.count=10",
            'monitor.display="off"', "proxy.workers=2"]
    args = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        t0 = time.monotonic()
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"source": "sandbox"' in metrics.read_text()):  # a rollout finished
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300, "the run did not start rolling out"
            time.sleep(0.2)
        started = {e["event"]: e["pid"] for e in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
                   if e.get("event", "").startswith("proxy-worker-")}
        os.kill(started["proxy-worker-1 process started"], signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    from pipeline.messages import ActorStopped

    stops = [e.msg for e in EventLogReader(run_dir / "events.msgpack") if isinstance(e.msg, ActorStopped)]
    crash = [s for s in stops if s.reason == "crashed"]
    assert [s.actor for s in crash] == ["proxy"] and "WorkerDied" in crash[0].error, stops
    assert "proxy worker 1" in crash[0].error and "exited with code -9" in crash[0].error, crash[0].error
    assert "proxy-worker-1.log" in crash[0].error
    with pytest.raises(ProcessLookupError):
        os.kill(started["proxy-worker-0 process started"], 0)


def test_an_attached_engine_that_stops_answering_fails_a_live_evaluation(tmp_path):
    """An engine bridle did not start (``[proxy.engine] url``) has no exit status to watch, only /health; an
    evaluation pushes no weights, so nothing else would notice. Killed mid-run, the engine fails the run at once
    (exit 1) with the watchdog's words; before the watchdog such a run waited on its harnesses' timeouts."""
    import tomllib

    import msgspec

    from pipeline.messages import ActorStopped
    from pipeline.models.quickstart import ModelSpec, ensure_model

    build = tomllib.loads((ROOT / "configs" / "quickstart.toml").read_text())["experiment"]["build_model"]
    model = ensure_model(msgspec.convert({**build, "tasks": 20, "path": str(tmp_path / "model")}, ModelSpec))
    port_file = tmp_path / "engine.port"
    engine = subprocess.Popen([sys.executable, "-m", "pipeline.serving.embedded", "--model", str(model), "--host",
                               "127.0.0.1", "--port", "0", "--port-file", str(port_file)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = tmp_path / "eval"
    proc = None
    try:
        t0 = time.monotonic()
        while not port_file.exists():
            assert engine.poll() is None and time.monotonic() - t0 < 120, "the engine did not start"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        sets = [f'run.model="{model}"', f'proxy.engine={{kind="sglang", url="{url}"}}',
                "eval.tasks.count=20", "eval.samples=4", 'monitor.display="off"']
        args = [sys.executable, "run.py", "--eval", "--experiment", "quickstart", "--run-dir", str(run_dir),
                "--no-watch"]
        for s in sets:
            args += ["--set", s]
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"source": "sandbox"' in metrics.read_text()):  # a rollout finished
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300, "the evaluation did not start rolling out"
            time.sleep(0.2)
        engine.kill()
        killed_at = time.monotonic()
        _out, err = proc.communicate(timeout=120)
        print(f"the run stopped {time.monotonic() - killed_at:.1f} s after the engine was killed")
    finally:
        for p in (engine, proc):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    stops = [e.msg for e in EventLogReader(run_dir / "events.msgpack") if isinstance(e.msg, ActorStopped)]
    crash = [s for s in stops if s.reason == "crashed"]
    assert [s.actor for s in crash] == ["proxy"] and "EngineDied" in crash[0].error, stops
    assert f"the engine at {url}" in crash[0].error and "health probes in a row" in crash[0].error, crash[0].error


def test_a_run_in_which_no_rollout_succeeded_exits_3_and_says_why(tmp_path):
    """Every rollout times out: the run still ends, but not as a success, and the reason is where a person looks
    (stderr, the log, the --replay summary), not only inside events.msgpack."""
    run_dir = tmp_path / "run"
    sets = [f'run.model="{tmp_path / "model"}"', "experiment.build_model.tasks=60", "scheduler.sft_groups=0",
            "run.steps=1", "run.groups_per_step=1", "scheduler.group_size=2", "scheduler.timeout_s=0.01",
            'monitor.display="log"']
    r = run_py("--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
               *(x for s in sets for x in ("--set", s)))
    assert r.returncode == 3, r.stderr[-3000:]
    verdict = [line for line in r.stderr.splitlines() if line.startswith("run.py: no rollout succeeded")]
    assert len(verdict) == 1 and "timeout" in verdict[0] and "first: " in verdict[0], r.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "no rollout succeeded" and e.get("level") == "error" for e in events)
    summary = run_py("--replay", str(run_dir)).stdout
    statuses = next(line for line in summary.splitlines() if line.startswith("statuses"))
    assert "timeout" in statuses and "ok" not in statuses, summary
    assert any(line.strip().startswith("timeout") and "first: " in line for line in summary.splitlines()), summary
