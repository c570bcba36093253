"""The local sandbox backend: statuses, rewards, cleanup of processes and directories, cancellation."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
import structlog

from pipeline.core.runfiles import marked_pids
from pipeline.core.runtime import _EMERGENCY, emergency_stop
from pipeline.messages import RolloutRequest
from pipeline.rollout.harnesses import HARNESSES, find_binary
from pipeline.rollout.sandbox import LocalBackend, LocalSettings, local
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.sandbox.local import MARKER_RUN
from pipeline.rollout.sandbox.util import rollout_dir
from pipeline.rollout.scheduling import oracle_script
from pipeline.rollout.taskgen import family_names, generate
from pipeline.rollout.tasks import Task, materialize
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy
from tests.helpers.users import as_nobody

pytestmark = pytest.mark.anyio
FORWARDER = Path(__file__).resolve().parents[2] / "harness_images" / "base" / "forwarder.py"


def request(harness: str, task: Task, timeout_s: float = 60.0, rid: str = "r1") -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id=task.id, harness=harness,
                          token="tok", policy_version=0, timeout_s=timeout_s)


def variant(tmp: Path, name: str, *, solve: str | None = None, test_sh: str | None = None,
            family: str = "create_file", seed: int = 0) -> Task:
    """A built-in task whose oracle (solution/solve.sh) or verifier is replaced: a stand-in harness."""
    spec = generate(family, seed)
    solution = dict(spec.solution) if solve is None else {"solve.sh": "#!/usr/bin/env bash\n" + solve + "\n"}
    tests = dict(spec.tests) if test_sh is None else {**spec.tests, "test.sh": test_sh}
    spec = msgspec.structs.replace(spec, solution=solution, tests=tests)
    return materialize(spec, tmp / name)


def leftovers(b: LocalBackend) -> list[int]:
    return marked_pids(f"{MARKER_RUN}={b.run_id}".encode())


@pytest.mark.parametrize("family", family_names())
async def test_oracle_scores_one_untouched_zero(tmp_path, family):
    b = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await b.start()
    task = materialize(generate(family, 1), tmp_path / "task")
    ok = await b.run(request("oracle", task), task, proxy_url="http://127.0.0.1:9")
    assert (ok.status, ok.reward, ok.exit_code) == ("ok", 1.0, 0), ok.details
    assert ok.timings.queued <= ok.timings.sandbox_ready <= ok.timings.harness_done <= ok.timings.verified
    idle = variant(tmp_path, "idle", solve="exit 0", family=family, seed=1)
    zero = await b.run(request("oracle", idle), idle, proxy_url="http://127.0.0.1:9")
    assert (zero.status, zero.reward) == ("ok", 0.0), zero.details
    assert list((tmp_path / "work").iterdir()) == []  # rollout directories are removed
    await b.aclose()


async def test_whitebox_through_proxy_scores_one(tmp_path):
    task = materialize(generate("create_file", 3), tmp_path / "task")
    action = task.oracle_actions[0]
    script = Script(default=[ScriptResponse(tool_calls=[ScriptCall(name="write_file", arguments=action.args)]),
                         ScriptResponse(text="Done.")])
    b = LocalBackend()
    async with running_proxy(script) as (proxy, records, _):
        req = request("whitebox:S1T0O1C0W0", task)
        proxy.register(req)
        fin = await b.run(req, task, proxy_url=proxy.base_url)
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    assert len([r for r in records if type(r).__name__ == "ModelCall"]) == 2


async def test_timeout_kills_the_whole_tree(tmp_path):
    # A background child, and one that left the process group (setsid): both must die with the harness.
    task = variant(tmp_path, "sleepy", solve="sleep 300 &\nsetsid sleep 301 &\necho started\nsleep 302")
    b = LocalBackend()
    fin = await b.run(request("oracle", task, timeout_s=1.0), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "timeout" and fin.reward == 0.0, fin.details
    assert "killed after 1s" in fin.details and "started" not in fin.details  # the sandbox's text stays out
    assert leftovers(b) == []


async def test_crash_is_harness_error(tmp_path):
    task = variant(tmp_path, "crash", solve="echo boom >&2\nsleep 300 &\nexit 3")
    b = LocalBackend()
    fin = await b.run(request("oracle", task), task, proxy_url="http://127.0.0.1:9")
    assert (fin.status, fin.exit_code) == ("harness_error", 3)
    assert "harness exited with 3" in fin.details and "boom" not in fin.details
    assert leftovers(b) == []


async def test_verifier_without_reward_is_verifier_error(tmp_path):
    task = variant(tmp_path, "noreward", test_sh="#!/usr/bin/env bash\necho checked\n")
    fin = await LocalBackend().run(request("oracle", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "verifier_error"
    # bridle's words only: test.sh's output never goes into the details (nor the event log)
    assert fin.details == "test.sh wrote neither logs/verifier/reward.txt nor reward.json (test.sh exit code 0)"


@pytest.mark.parametrize("keep", [False, True])
async def test_harness_output_swapped_for_a_link_is_not_followed(tmp_path, keep):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET")
    task = variant(tmp_path, "swap", solve=f'echo visible\nln -sf {secret} "$BRIDLE_WORKSPACE/../logs/harness.txt"\nexit 3')
    b = LocalBackend(LocalSettings(), common=SandboxCommon(keep_workspaces=keep, workdir=str(tmp_path / "work")))
    fin = await b.run(request("oracle", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "harness_error" and "HOST-SECRET" not in fin.details, fin.details
    assert secret.read_text() == "HOST-SECRET"


async def test_missing_harness_binary_is_sandbox_error(tmp_path):
    task = materialize(generate("create_file", 0), tmp_path / "task")
    b = LocalBackend(LocalSettings(harness_bin=str(tmp_path)))
    fin = await b.run(request("claude-code", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "sandbox_error" and "BRIDLE_HARNESS_BIN" in fin.details
    fin = await b.run(request("openclaw", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "sandbox_error" and "npm install node-linux-" in fin.details  # and the Node it runs on


async def test_unknown_harness_is_sandbox_error(tmp_path):
    task = materialize(generate("create_file", 0), tmp_path / "task")
    fin = await LocalBackend().run(request("nope", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "sandbox_error" and "unknown harness" in fin.details


async def test_rlimits_and_kept_workspace(tmp_path):
    task = variant(tmp_path, "limits", solve='ulimit -n > "$BRIDLE_WORKSPACE/nofile"; ulimit -c > "$BRIDLE_WORKSPACE/core"')
    b = LocalBackend(LocalSettings(open_files=123), common=SandboxCommon(workdir=str(tmp_path / "work"), keep_workspaces=True))
    fin = await b.run(request("oracle", task), task, proxy_url="http://127.0.0.1:9")
    assert fin.status == "ok"
    (kept,) = (tmp_path / "work").iterdir()
    assert (kept / "app" / "nofile").read_text().strip() == "123"
    assert (kept / "app" / "core").read_text().strip() == "0"
    assert (kept / "logs" / "verifier" / "reward.txt").is_file()


async def test_cancellation_kills_and_cleans(tmp_path):
    task = variant(tmp_path, "forever", solve="setsid sleep 300 &\nsleep 300")
    b = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(tmp_path / "work")))
    started = anyio.Event()

    async def watch():
        await until(lambda: leftovers(b))
        started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(b.run, request("oracle", task), task, proxy_url="http://127.0.0.1:9"))
        await watch()
        tg.cancel_scope.cancel()
    assert started.is_set()
    assert leftovers(b) == []
    assert list((tmp_path / "work").iterdir()) == []


async def test_start_reaps_a_crashed_runs_processes_and_workspaces(tmp_path):
    # What an earlier backend with the same run id left (e.g. the pool was SIGKILLed): a harness process and
    # rollout directories; another run's directory stays.
    run = f"crashed-{uuid.uuid4().hex[:8]}"
    proc = await anyio.open_process(["sleep", "300"], env={"PATH": "/usr/bin:/bin", MARKER_RUN: run},
                                    start_new_session=True)
    work = tmp_path / "work"
    mine = [rollout_dir(str(work), run, rid) for rid in ("g00001-r0", "g00002-a1-r3")]
    (mine[0] / "app" / "deep").mkdir(parents=True)
    other = rollout_dir(str(work), f"{run}-2", "g00001-r0")
    b = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(work)), run_id=run)
    # a verifier's folder in the temp dir (its tests and HOME), as a kill -9 mid-verification leaves it
    verifying = tempfile.mkdtemp(prefix=b._verify_prefix)
    others_verifier = tempfile.mkdtemp(prefix=LocalBackend(LocalSettings(), run_id=f"{run}-2")._verify_prefix)
    # until the child has exec'd: before that its /proc environ is still the parent's, without the marker (a
    # loaded machine showed it: the reaper had nothing to find yet)
    await until(lambda: leftovers(b) == [proc.pid], timeout_s=30)
    await b.start()
    await proc.wait()
    assert leftovers(b) == []
    assert list(work.iterdir()) == [other]
    assert not await anyio.Path(verifying).exists() and await anyio.Path(others_verifier).is_dir()
    await anyio.Path(others_verifier).rmdir()
    await b.aclose()


async def test_emergency_stop_kills_every_harness_and_removes_the_workspaces(tmp_path):
    """What a second Ctrl-C runs (pipeline.core.runtime.emergency_stop): synchronous, with the event loop
    abandoned, so the harnesses (in sessions of their own) do not outlive bridle."""
    task = variant(tmp_path, "forever", solve="setsid sleep 300 &\nsleep 300")
    b = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await b.start()
    assert b.emergency_stop in _EMERGENCY.values()
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(partial(b.run, request("oracle", task, rid=f"r{i}"), task, proxy_url="http://127.0.0.1:9"))
        await until(lambda: len(leftovers(b)) >= 4)  # two harnesses, each with a child in its own session
        assert len(list((tmp_path / "work").iterdir())) == 2
        emergency_stop()
        assert leftovers(b) == []
        assert list((tmp_path / "work").iterdir()) == []
        tg.cancel_scope.cancel()
    await b.aclose()
    assert b.emergency_stop not in _EMERGENCY.values()


async def test_forwarder_relays_loopback_to_the_proxy_socket(tmp_path):
    """The image's forwarder, run here: TCP on loopback -> the proxy's Unix socket, then exec of the command."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = tmp_path / "proxy.sock"
    client = ("import sys, urllib.request; "
              f"r = urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=10); "
              "sys.exit(0 if r.status == 200 else 1)")
    async with running_proxy(unix_socket=str(sock)):
        with anyio.fail_after(60):  # the relay must die with the command, or this would hang on its pipes
            proc = await anyio.run_process(
                [sys.executable, str(FORWARDER), "--listen", f"127.0.0.1:{port}", "--socket", str(sock), "--",
                 sys.executable, "-c", client], check=False)
    assert proc.returncode == 0, proc.stderr.decode()


REAL_HARNESSES = ["claude-code", "codex", "qwen-code", "openclaw"]


@pytest.mark.harness
@pytest.mark.parametrize("family", ["text_processing", "bugfix"])  # read + write; read, edit, shell
@pytest.mark.parametrize("harness", REAL_HARNESSES)
async def test_real_harness_local_scores_one(tmp_path, harness, family):
    """The task's oracle in the harness's own tools (the demonstration the scheduler scripts) scores 1."""
    adapter = HARNESSES[harness]
    exe = find_binary(adapter.executable)
    require(exe is not None, f"{harness} binary not installed (set BRIDLE_HARNESS_BIN)")
    task = materialize(generate(family, 4), tmp_path / "task")
    script = Script(default=msgspec.convert(oracle_script(task, harness), list[ScriptResponse]))
    b = LocalBackend()
    async with running_proxy(script) as (proxy, records, _):
        req = request(harness, task, timeout_s=240)
        proxy.register(req)
        fin = await b.run(req, task, proxy_url=proxy.base_url)
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    calls = [r for r in records if type(r).__name__ == "ModelCall"]
    assert len(calls) >= len(script.default), (len(calls), fin.details)
    # the harness echoes every scripted call as it was sampled: the demonstration is history token for token
    assert [c.rendered_turns for c in calls] == [0] * len(calls)
    assert leftovers(b) == []


async def test_without_pid_namespaces_the_local_backend_says_at_start_that_it_is_not_for_untrusted_policies(
        tmp_path, monkeypatch):
    """Where PID namespaces cannot be made (not root), the local backend cannot end what a harness left running:
    it says so once at start, naming the Docker backend; where they can, it says nothing."""
    probe = local._pid_namespaces_work
    said = {}
    for works in (False, True):
        monkeypatch.setattr(local, "_pid_namespaces_work", lambda works=works: works)
        b = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(tmp_path / "work")))
        with structlog.testing.capture_logs() as lines:
            await b.start()
            await b.aclose()
        said[works] = [x["event"] for x in lines if x["log_level"] == "warning"]
    assert len(said[False]) == 1 and "Use the docker backend for policies you do not trust" in said[False][0]
    assert said[True] == []
    # the probe itself: as root here PID namespaces work; the sandbox's unprivileged user cannot make one
    if os.geteuid() == 0:
        assert await anyio.to_thread.run_sync(probe)
        assert await anyio.to_thread.run_sync(as_nobody, probe) is False

