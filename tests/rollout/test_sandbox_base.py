"""The status decision of SandboxBackend.run, with no process or container: a backend whose hooks play a script.

Each case scripts how the hooks end (the harness's exit, the verifier's verdict, a failure in one hook, a
cancellation) and checks the RolloutFinished exactly: status, reward, exit code, details, timings, and which hooks
ran. The clock is a counter, so the timings say which phases completed. Then the helpers both backends share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.messages import RolloutFinished, RolloutRequest, RolloutTimings
from pipeline.rollout.sandbox import base
from pipeline.rollout.sandbox.base import (
    HarnessExit,
    Sandbox,
    SandboxBackend,
    SandboxError,
    Verdict,
    VerifierError,
)
from pipeline.rollout.sandbox.util import parse_size, tail
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, materialize

pytestmark = pytest.mark.anyio

EXIT0 = HarnessExit(timed_out=False, exit_code=0)
PASS = Verdict(reward=1.0, rewards={"rule": 1.0}, summary="verifier: all passed")
ALL = ["prepare", "launch", "wait", "release", "verify", "cleanup"]
HANG = object()  # a hook scripted with this waits until cancelled


@dataclass(kw_only=True)
class FakeSandbox(Sandbox):
    pass


class Scripted(SandboxBackend[FakeSandbox]):
    """Each hook returns its scripted value, raises it when it is an exception, or waits forever for HANG."""

    kind = "scripted"
    sandbox_type = FakeSandbox
    memory_limit = "2g"

    def __init__(self, **script: Any):
        super().__init__(run_id="test")
        self.script = {"wait": EXIT0, "logs": "harness: done", "verify": PASS, **script}
        self.calls: list[str] = []
        self.timeouts: list[float] = []
        self.hanging = anyio.Event()

    async def _play(self, hook: str) -> Any:
        self.calls.append(hook)
        value = self.script.get(hook)
        if value is HANG:
            self.hanging.set()
            await anyio.sleep_forever()
        if isinstance(value, BaseException):
            raise value
        return value

    async def start(self) -> None:
        return

    async def aclose(self) -> None:
        return

    async def prepare(self, box: FakeSandbox) -> None:
        await self._play("prepare")

    async def launch(self, box: FakeSandbox) -> None:
        await self._play("launch")

    async def wait(self, box: FakeSandbox, timeout_s: float) -> HarnessExit:
        self.timeouts.append(timeout_s)
        return await self._play("wait")

    async def logs(self, box: FakeSandbox) -> str:
        return await self._play("logs")

    async def release(self, box: FakeSandbox) -> None:
        await self._play("release")

    async def verify(self, box: FakeSandbox) -> Verdict:
        return await self._play("verify")

    async def cleanup(self, box: FakeSandbox) -> None:
        await self._play("cleanup")
        await anyio.sleep(0.01)  # a checkpoint: an unshielded cleanup would be cancelled here
        self.calls.append("cleaned")


class Clock:
    """time.time() for base.py: 1, 2, 3, ... so that each timing says how many phases had completed."""

    def __init__(self):
        self.ticks = itertools.count(1.0)

    def time(self) -> float:
        return next(self.ticks)


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    monkeypatch.setattr(base, "time", Clock())


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    return materialize(generate("create_file", 0), tmp_path_factory.mktemp("task") / "t")


def request(task: Task, harness: str = "oracle", timeout_s: float = 5.0) -> RolloutRequest:
    return RolloutRequest(rollout_id="r1", group_id="g", index=0, group_size=1, task_id=task.id, harness=harness,
                          token="tok", policy_version=0, timeout_s=timeout_s)


async def run(backend: Scripted, task: Task, **kw: Any) -> RolloutFinished:
    return await backend.run(request(task, **kw), task, proxy_url="http://127.0.0.1:9")


def timings(*ticks: float) -> RolloutTimings:
    """queued, sandbox_ready, harness_done, verified; missing ones are 0 (that phase never completed)."""
    t = [*ticks, 0.0, 0.0, 0.0][:4]
    return RolloutTimings(queued=t[0], sandbox_ready=t[1], harness_done=t[2], verified=t[3])


# ------------------------------------------------------------------------------------------ exact cases
async def test_exit_0_is_ok_with_the_verifiers_reward(task):
    b = Scripted()
    fin = await run(b, task)
    assert (fin.rollout_id, fin.group_id) == ("r1", "g")
    assert (fin.status, fin.reward, fin.rewards, fin.exit_code) == ("ok", 1.0, {"rule": 1.0}, 0)
    assert fin.details == "verifier: all passed"
    assert fin.timings == timings(1, 2, 3, 4)
    assert b.calls == [*ALL, "cleaned"]
    assert b.timeouts == [5.0]


async def test_exit_0_with_reward_0_is_still_ok(task):
    fin = await run(Scripted(verify=Verdict(reward=0.0, rewards={"rule": 0.0}, summary="0/3")), task)
    assert (fin.status, fin.reward, fin.rewards, fin.exit_code, fin.details) == ("ok", 0.0, {"rule": 0.0}, 0, "0/3")


async def test_non_zero_exit_is_harness_error_and_not_verified(task):
    b = Scripted(wait=HarnessExit(timed_out=False, exit_code=3))
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.rewards, fin.exit_code) == ("harness_error", 0.0, {}, 3)
    assert fin.details == "harness exited with 3 (its output is kept with [sandbox] keep_workspaces = true)"
    assert fin.timings == timings(1, 2, 3)
    assert b.calls == ["prepare", "launch", "wait", "release", "cleanup", "cleaned"]


@pytest.mark.parametrize("exit_code", [-9, 0, 137])
async def test_timeout_is_scored_whatever_the_exit_code(task, exit_code):
    b = Scripted(wait=HarnessExit(timed_out=True, exit_code=exit_code),
                 verify=Verdict(reward=0.5, rewards={"rule": 0.5, "part": 1.0}, summary="half"))
    fin = await run(b, task, timeout_s=2.5)
    assert (fin.status, fin.reward, fin.rewards, fin.exit_code) == ("timeout", 0.5, {"rule": 0.5, "part": 1.0}, None)
    assert fin.details == "harness killed after 2.5s ([scheduler] timeout_s) (its output is kept with [sandbox] keep_workspaces = true)"
    assert fin.timings == timings(1, 2, 3, 4)
    assert b.calls == [*ALL, "cleaned"]
    assert b.timeouts == [2.5]


async def test_out_of_memory_is_harness_error_naming_the_limit(task):
    b = Scripted(wait=HarnessExit(timed_out=False, exit_code=137, out_of_memory=True))
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.exit_code) == ("harness_error", 0.0, 137)
    assert fin.details == "the harness ran out of memory (limit 2g) (its output is kept with [sandbox] keep_workspaces = true)"
    assert "verify" not in b.calls and b.calls[-2:] == ["cleanup", "cleaned"]


async def test_out_of_memory_wins_over_killed_from_outside(task):
    b = Scripted(wait=HarnessExit(timed_out=False, exit_code=137, out_of_memory=True, killed_from_outside=True))
    assert (await run(b, task)).status == "harness_error"


async def test_killed_from_outside_is_sandbox_error(task):
    b = Scripted(wait=HarnessExit(timed_out=False, exit_code=137, killed_from_outside=True))
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.exit_code) == ("sandbox_error", 0.0, 137)
    assert fin.details == "the sandbox was killed from outside (its output is kept with [sandbox] keep_workspaces = true)"
    assert fin.timings == timings(1, 2, 3)
    assert "verify" not in b.calls and b.calls[-2:] == ["cleanup", "cleaned"]


async def test_a_timeout_is_never_blamed_on_memory_or_outsiders(task):
    b = Scripted(wait=HarnessExit(timed_out=True, exit_code=137, out_of_memory=True, killed_from_outside=True))
    assert (await run(b, task)).status == "timeout"


@pytest.mark.parametrize(("ended", "exit_code"), [(EXIT0, 0), (HarnessExit(timed_out=True, exit_code=-9), -9)])
async def test_verifier_error_keeps_the_harness_exit_code_and_no_reward(task, ended, exit_code):
    b = Scripted(wait=ended, verify=VerifierError("no reward.txt\nchecked"))
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.rewards, fin.exit_code) == ("verifier_error", 0.0, {}, exit_code)
    assert fin.details == "no reward.txt\nchecked"
    assert fin.timings == timings(1, 2, 3, 4)
    assert b.calls == [*ALL, "cleaned"]


async def test_prepare_failure_is_sandbox_error_and_still_cleaned(task):
    b = Scripted(prepare=SandboxError("claude-code executable not found"))
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.exit_code, fin.details) == (
        "sandbox_error", 0.0, None, "claude-code executable not found")
    assert fin.timings == timings(1)
    assert b.calls == ["prepare", "cleanup", "cleaned"]


@pytest.mark.parametrize(("error", "details"), [
    (OSError(28, "No space left on device"), "could not prepare the sandbox: OSError: [Errno 28] No space left on device"),
    (ValueError("bad size"), "could not prepare the sandbox: ValueError: bad size"),
])
async def test_prepare_os_and_value_errors_are_sandbox_error(task, error, details):
    b = Scripted(prepare=error)
    fin = await run(b, task)
    assert (fin.status, fin.details) == ("sandbox_error", details)
    assert b.calls == ["prepare", "cleanup", "cleaned"]


async def test_launch_failure_is_sandbox_error_and_still_cleaned(task):
    b = Scripted(launch=SandboxError("could not start the container (bridle-x): 404; build the images"))
    fin = await run(b, task)
    assert (fin.status, fin.details) == ("sandbox_error", "could not start the container (bridle-x): 404; build the images")
    assert fin.timings == timings(1)
    assert b.calls == ["prepare", "launch", "cleanup", "cleaned"]


async def test_sandbox_gone_under_the_harness_is_sandbox_error_without_its_output(task):
    b = Scripted(wait=SandboxError("the container disappeared"), logs="half a line")
    fin = await run(b, task)
    assert (fin.status, fin.reward, fin.exit_code) == ("sandbox_error", 0.0, None)
    assert fin.details == "the container disappeared (its output is kept with [sandbox] keep_workspaces = true)"
    assert fin.timings == timings(1, 2)
    assert b.calls == ["prepare", "launch", "wait", "cleanup", "cleaned"]


@pytest.mark.parametrize(("harness", "want"), [
    ("nope", ('could not prepare the sandbox: ValueError: unknown harness "nope"; known: claude-code[:lean], '
              "codex, qwen-code, openclaw, whitebox[:SxTxOxCxWx], oracle, imageless")),
    ("imageless", ('could not prepare the sandbox: ValueError: harness "imageless" has no sandbox image yet; the '
                   "sandboxes run claude-code[:lean], codex, qwen-code, openclaw, whitebox[:SxTxOxCxWx], oracle")),
    # a request that slipped past the config's checks is refused too, not run as another harness configuration
    ("codex:lean", ('could not prepare the sandbox: ValueError: harness "codex:lean": codex has no variants; name it '
                    '"codex"')),
    ("claude-code:x", ('could not prepare the sandbox: ValueError: harness "claude-code:x": no variant "x"; its '
                       "variants: lean")),
])
async def test_harness_the_sandboxes_cannot_run_is_sandbox_error_before_any_hook(task, harness, want, monkeypatch):
    from pipeline.rollout import harnesses

    # every shipped harness has an image; an adapter added without one is refused under both backends
    monkeypatch.setitem(harnesses.HARNESSES, "imageless", harnesses.Harness("imageless", harnesses.oracle))
    b = Scripted()
    fin = await run(b, task, harness=harness)
    assert (fin.status, fin.details) == ("sandbox_error", want)
    assert b.calls == []


async def test_oracle_without_solution_is_sandbox_error_before_any_hook(tmp_path):
    bare = materialize(msgspec.structs.replace(generate("create_file", 0), solution={}), tmp_path / "bare")
    assert not (bare.root / "solution").exists()
    b = Scripted()
    fin = await run(b, bare)
    assert (fin.status, fin.details) == ("sandbox_error", f"task {bare.id} has no solution/ for the oracle harness")
    assert b.calls == []
    assert (await run(Scripted(), bare, harness="whitebox")).status == "ok"  # only the oracle needs one


@pytest.mark.parametrize("wait", [HarnessExit(timed_out=False, exit_code=1), HarnessExit(timed_out=True, exit_code=-9),
                                  SandboxError("the container disappeared")])
async def test_the_harness_output_never_reaches_the_details_and_is_kept_only_when_asked(task, tmp_path, wait):
    secret = "root:x:0:0:root:/root:/bin/bash /dev/sda1 /var/lib/docker"  # what a harness may print
    plain = await run(Scripted(wait=wait, logs=secret), task)
    assert secret not in plain.details and "keep_workspaces = true" in plain.details

    kept = Scripted(wait=wait, logs=secret)
    kept.keep_workspaces = True
    root = tmp_path / "bridle-run-r1-abc"
    root.mkdir()

    async def prepare(box: FakeSandbox) -> None:
        box.root = root

    kept.prepare = prepare
    fin = await run(kept, task)
    assert secret not in fin.details and "logs/harness.txt in the kept rollout folder bridle-run-r1-abc" in fin.details
    assert (root / "logs" / "harness.txt").read_text() == secret


# ----------------------------------------------------------------------------------- cancellation, cleanup
@pytest.mark.parametrize("hook", ["prepare", "launch", "wait", "verify"])
async def test_cancellation_propagates_after_a_shielded_cleanup(task, hook):
    b = Scripted(**{hook: HANG})
    result: list[RolloutFinished] = []

    async def one() -> None:
        result.append(await run(b, task))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await b.hanging.wait()
        tg.cancel_scope.cancel()
    assert b.calls[b.calls.index(hook) + 1:] == ["cleanup", "cleaned"]
    assert result == []  # cancelled: no RolloutFinished


async def test_a_hanging_cleanup_is_bounded(task):
    b = Scripted(cleanup=HANG)
    b.cleanup_timeout_s = 0.05
    with anyio.fail_after(10):
        fin = await run(b, task)
    assert fin.status == "ok" and b.calls[-1] == "cleanup"


async def test_an_unexpected_error_propagates_after_cleanup(task):
    b = Scripted(verify=RuntimeError("a bug in the backend"))
    with pytest.raises(RuntimeError, match="a bug"):
        await run(b, task)
    assert b.calls[-2:] == ["cleanup", "cleaned"]


# --------------------------------------------------------------------------------------------- property
EXITS = st.builds(HarnessExit, timed_out=st.booleans(), exit_code=st.sampled_from([None, -9, 0, 1, 3, 137]),
                  out_of_memory=st.booleans(), killed_from_outside=st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ended=EXITS, verifier_ok=st.booleans(), reward=st.sampled_from([0.0, 0.25, 1.0]))
def test_any_ending_gets_the_documented_status(task, ended, verifier_ok, reward):
    verdict = Verdict(reward=reward, rewards={"rule": reward}, summary="v") if verifier_ok else VerifierError("bad")
    b = Scripted(wait=ended, verify=verdict)
    base.time = Clock()  # the fixture's clock is per test, not per example
    fin = anyio.run(run, b, task)
    scored = ended.timed_out or not (ended.out_of_memory or ended.killed_from_outside or ended.exit_code != 0)
    assert ("verify" in b.calls) == scored
    if not scored:
        want = ("harness_error" if ended.out_of_memory or not ended.killed_from_outside else "sandbox_error")
    elif not verifier_ok:
        want = "verifier_error"
    else:
        want = "timeout" if ended.timed_out else "ok"
    assert fin.status == want
    assert fin.reward == (reward if want in ("ok", "timeout") else 0.0)
    assert fin.exit_code == {"ok": 0, "timeout": None}.get(want, ended.exit_code)
    assert b.calls.count("cleanup") == 1 and b.calls[-1] == "cleaned"
    assert fin.timings == (timings(1, 2, 3, 4) if scored else timings(1, 2, 3))


# ------------------------------------------------------------------------------------------------ helpers
def test_size_parsing():
    assert parse_size("4g", "m") == 4 << 30
    assert parse_size("512m", "m") == 512 << 20
    assert parse_size("1.5k", "m") == 1536
    assert parse_size(100, "m") == 100
    assert parse_size(None, "m") is None
    with pytest.raises(ValueError, match="memory"):
        parse_size("lots", "memory")


def test_tail():
    assert tail("abc", 3) == "abc"
    assert tail("abcd", 3) == "...bcd"


def test_every_backend_is_a_sandbox_backend():
    from pipeline.rollout.sandbox import DockerBackend, LocalBackend

    for cls in (LocalBackend, DockerBackend):
        assert issubclass(cls, SandboxBackend)
        assert issubclass(cls.sandbox_type, Sandbox)
        assert not getattr(cls, "__abstractmethods__", None), cls
