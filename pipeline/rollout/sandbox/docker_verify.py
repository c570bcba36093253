"""The Docker backend's verifier: Harbor's contract in a fresh container from the task's image.

Only after the harness's container is gone: a fresh copy of ``tests/`` (read-only, 0700) at ``/tests``, an empty
``/logs/verifier``, the final workspace at the task's WORKDIR, and ``bash /tests/test.sh`` from there as root, on
``[sandbox.docker] verifier_network``, under the task's limits and ``[verifier] timeout_sec``; the reward is read
from ``logs/verifier/reward.txt`` or ``reward.json`` on the host without following links.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio

from pipeline.core.logs import get_logger
from pipeline.rollout.sandbox.base import SandboxError, Verdict, VerifierError
from pipeline.rollout.sandbox.container import DockerEngine, DockerSandbox, DockerSettings, TaskLimits
from pipeline.rollout.sandbox.task_images import network_failure
from pipeline.rollout.tasks import Task
from pipeline.rollout.untrusted import RewardError, UntrustedFileError, fresh_dir, read_reward, read_under
from pipeline.rollout.verify import summarize

log = get_logger(component="sandbox")

OUTPUT_SCAN_CAP = 1 << 20  # how much of test.sh's output is searched for signs of a missing network


async def verify_in_container(backend: DockerEngine, box: DockerSandbox) -> Verdict:
    """Run tests/test.sh as root in a fresh container from the task's image over the workspace, from the
    WORKDIR, with tests/ read-only and 0700, on ``verifier_network``.

    test.sh is the task author's (trusted); the built-in tasks' checker runs workspace code in a child as uid
    65534, which can read neither /tests nor /logs (both 0700). ``PYTHONSAFEPATH=1`` keeps the workspace (the
    working directory) off the front of ``sys.path`` of ``python -m`` / ``-c``, so a module the agent left there
    cannot shadow what test.sh imports (a task's ``[verifier] env`` may set it otherwise). The reward file is
    read on the host without following links; test.sh's output stays in logs/verifier/test-stdout.txt and never
    reaches the details (it is only searched for signs of a missing network).
    """
    import aiodocker

    assert box.root is not None and box.image is not None
    root, task, wd, s = box.root, box.task, box.image.workdir, backend.settings
    if not s.verifier_image and not box.image.bash:
        raise VerifierError(f"the task image {box.image.ref} has no bash, which runs tests/test.sh (Harbor's "
                            "contract); add bash to environment/Dockerfile")
    tests, logs = await anyio.to_thread.run_sync(verifier_dirs, root, task)
    limit_s = task.config.verifier.timeout_sec
    env = {"BRIDLE_WORKSPACE": wd, "BRIDLE_TESTS": "/tests", "BRIDLE_LOGS": "/logs", "PYTHONSAFEPATH": "1",
           **task.config.verifier.env}
    config = {
        "Image": s.verifier_image or box.image.ref,
        "Entrypoint": [],
        "Cmd": ["bash", "-c", "bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1"],
        "Env": [f"{k}={v}" for k, v in env.items()],
        "User": "0:0",
        "WorkingDir": wd,
        "Labels": backend._labels(box.req, "verifier"),
        "HostConfig": verifier_host_config(
            backend, [f"{root / 'app'}:{wd}", f"{tests}:/tests:ro", f"{logs}:/logs"], box.task_limits),
    }
    try:
        c = await backend._create_start(config, {}, box.containers)
    except (aiodocker.DockerError, TimeoutError) as e:
        raise VerifierError(f"could not start the verifier container ({config['Image']}): {e}") from None
    try:
        timed_out, state = await backend._wait(c, limit_s)
    except SandboxError as e:
        raise VerifierError(f"verifier container failed: {e}") from None
    await backend._remove(c.id)
    if timed_out:
        raise VerifierError(f"test.sh timed out after {limit_s:g}s{await offline_hint(s, logs)}")
    code = state.get("ExitCode")
    try:
        reward, parts = await anyio.to_thread.run_sync(read_reward, logs / "verifier")
    except RewardError as e:
        raise VerifierError(f"{e} (test.sh exit code {code}){await offline_hint(s, logs)}") from None
    if await offline_hint(s, logs):
        box.notes.append("test.sh's output shows a failed network lookup and the verifier has no network "
                         '([sandbox.docker] verifier_network = "none"): its reward may be wrong')
        log.warning("verifier_offline_failure", rollout=box.req.rollout_id, task=task.id, reward=reward)
    rewards = {**parts, "rule": reward}
    return Verdict(reward=reward, rewards=rewards, summary=summarize(reward, rewards, code))


async def offline_hint(settings: DockerSettings, logs: Path) -> str:
    """What to add to a verifier error when the verifier had no network and test.sh's output shows a failed
    lookup ("" otherwise). The output decides only this; it is never quoted."""
    if settings.verifier_network != "none":
        return ""
    try:
        out = await anyio.to_thread.run_sync(
            lambda: read_under(logs, "verifier/test-stdout.txt", OUTPUT_SCAN_CAP, head=True))
    except (OSError, UntrustedFileError):
        return ""
    if not network_failure(out):
        return ""
    return ('; test.sh\'s output shows a failed network lookup, and the verifier has no network '
            '([sandbox.docker] verifier_network = "none"): its tests may need the internet (apt, uv, pip, curl); '
            'set verifier_network = "bridge", or make tests/ self-contained')


def verifier_host_config(backend: DockerEngine, binds: list[str], limits: TaskLimits | None) -> dict[str, Any]:
    """The harness's limits, but root with just what the trusted checker needs: read the 0700 tests/ and write
    logs/ whoever owns them on the host (DAC_OVERRIDE), and drop its child to another uid (SETUID, SETGID)."""
    return {
        **backend._host_config(binds, backend.settings.verifier_network, limits),
        "CapDrop": ["ALL"],
        "CapAdd": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID", "KILL"],
        "ReadonlyRootfs": False,  # the checker copies the workspace to /tmp for its child
    }


def verifier_dirs(root: Path, task: Task) -> tuple[Path, Path]:
    """(tests, logs) for the verifier container: a fresh copy of the task's tests/ and an empty logs/verifier/,
    both 0700 (root in the container reaches them; its uid-65534 child does not)."""
    tests, logs = root / "tests", root / "logs"
    fresh_dir(tests)
    tests.rmdir()
    shutil.copytree(task.tests_dir, tests, symlinks=True)
    tests.chmod(0o700)
    fresh_dir(logs, 0o700)
    fresh_dir(logs / "verifier", 0o700)
    return tests, logs
