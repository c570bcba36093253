"""Harbor tasks as Harbor runs them, in Docker: each task's own image (its environment/Dockerfile built offline from
the local base image), the oracle (solution/solve.sh) and a black-box harness laid over it, the task's limits and
timeouts, the verifier in the task's image, and what the agent may not do to the verifier.

The fixtures are tests/data/harbor/greeting (a tool, an ENV, a file under /etc and a WORKDIR only its image has) and
tests/data/harbor/guarded (pytest only in its image, run Harbor-style from the workspace). Skipped without Docker;
required in CI.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import uuid
from pathlib import Path

import anyio
import msgspec
import pytest

from pipeline.messages import RolloutFinished, RolloutRequest
from pipeline.rollout.sandbox import DockerBackend, DockerSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.scheduling import oracle_script
from pipeline.rollout.tasks import Task, load_task
from pipeline.serving.scripted import Script, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.docker import containers_of
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.docker]
HARBOR = Path(__file__).parents[1] / "data" / "harbor"
GREETING = "HELLO WORLD [7f3a]"  # what the greeting image's `greet world` prints


def harbor_task(tmp: Path, name: str, *, solve: str | None = None, test_sh: str | None = None,
                dockerfile: str | None = None, toml: str | None = None, files: dict[str, str] | None = None) -> Task:
    """A copy of the fixture ``name`` with some of its files replaced."""
    dest = tmp / f"{name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(HARBOR / name, dest)
    for rel, text in {"solution/solve.sh": solve, "tests/test.sh": test_sh, "environment/Dockerfile": dockerfile,
                      "task.toml": toml, **(files or {})}.items():
        if text is not None:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
    return load_task(dest)


def request(harness: str, task: Task, rid: str = "r1", timeout_s: float = 120.0) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id=task.id, harness=harness,
                          token=f"tok-{rid}", policy_version=0, timeout_s=timeout_s)


def backend_for(tmp: Path, **kw) -> DockerBackend:
    """This machine's tests: builds and verifiers without network (the fixtures need none)."""
    return DockerBackend(DockerSettings(verifier_network="none", build_network="none", **kw),
                         SandboxCommon(workdir=str(tmp / "work")))


@pytest.fixture
async def sandbox(images, tmp_path):
    sock = tmp_path / "proxy.sock"
    backend = backend_for(tmp_path)
    await backend.start()
    async with running_proxy(unix_socket=str(sock)) as (proxy, _records, _token):

        async def run(harness: str, task: Task, rid: str = "r1", **kw) -> RolloutFinished:
            return await backend.run(request(harness, task, rid, **kw), task, proxy_url=proxy.base_url,
                                     proxy_socket=str(sock))

        yield backend, run
    await backend.aclose()
    assert containers_of(backend.run_id) == []


async def inspect(cid: str) -> dict:
    return json.loads((await anyio.run_process(["docker", "inspect", cid])).stdout)[0]


# ------------------------------------------------------------------------------------------------ oracle
async def test_oracle_scores_one_and_a_wrong_solution_zero_in_the_task_image(sandbox, tmp_path):
    backend, run = sandbox
    task = harbor_task(tmp_path, "greeting")
    wrong = harbor_task(tmp_path, "greeting", solve="#!/usr/bin/env bash\necho 'hello world' > out.txt\n")
    elsewhere = harbor_task(tmp_path, "greeting", solve="#!/usr/bin/env bash\ngreet world > /tmp/out.txt\n")
    ok, bad, lost = [await run("oracle", t, rid) for t, rid in ((task, "a"), (wrong, "b"), (elsewhere, "c"))]
    assert (ok.status, ok.reward) == ("ok", 1.0), ok.details
    assert (bad.status, bad.reward) == ("ok", 0.0), bad.details
    assert (lost.status, lost.reward) == ("ok", 0.0), lost.details  # the workspace is the WORKDIR, not /tmp
    # allow_internet = true is reported, not honoured
    assert "allow_internet = true; not honoured" in ok.details
    image = await backend.task_images.resolve(task)
    assert image.ref.startswith("bridle-task:") and image.workdir == "/srv/project" and not image.built


async def test_limits_network_and_image_in_docker_inspect(sandbox, tmp_path):
    """cpus / memory / pids from task.toml, network none although the task allows the internet, the task's own
    image with the harness payload mounted read-only, a non-root uid on a read-only root."""
    backend, run = sandbox
    task = harbor_task(tmp_path, "greeting", solve="#!/usr/bin/env bash\nsleep 3\ngreet world > out.txt\n")
    seen: dict = {}

    async def watch():
        (cid,) = await until(lambda: containers_of(backend.run_id, running_only=True), every_s=0.1)
        seen.update(await inspect(cid))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        fin = await run("oracle", task)
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    hc, cfg = seen["HostConfig"], seen["Config"]
    assert (hc["NanoCpus"], hc["Memory"], hc["MemorySwap"], hc["PidsLimit"]) == (5 * 10**8, 384 << 20, 384 << 20, 200)
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True and hc["Privileged"] is False
    assert cfg["Image"].startswith("bridle-task:") and cfg["WorkingDir"] == "/srv/project"
    assert cfg["User"] != "0:0" and not cfg["User"].startswith("0:")
    mounts = {m["Destination"]: m for m in seen["Mounts"]}
    assert mounts["/opt/bridle-harness"]["RW"] is False and mounts["/srv/project"]["RW"] is True
    assert "GREETING_STYLE=shout" in cfg["Env"]  # the task image's environment


async def test_limits_above_the_settings_are_capped_and_said(images, tmp_path):
    toml = (HARBOR / "greeting" / "task.toml").read_text().replace('memory = "384M"', 'memory = "64G"')
    task = harbor_task(tmp_path, "greeting", toml=toml, solve="#!/usr/bin/env bash\nsleep 2\ngreet world > out.txt\n")
    sock = tmp_path / "proxy.sock"
    backend = backend_for(tmp_path, memory="512m")
    await backend.start()
    seen: dict = {}

    async def watch():
        (cid,) = await until(lambda: containers_of(backend.run_id, running_only=True), every_s=0.1)
        seen.update(await inspect(cid))

    async with running_proxy(unix_socket=str(sock)) as (proxy, _, _), anyio.create_task_group() as tg:
        tg.start_soon(watch)
        fin = await backend.run(request("oracle", task), task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    await backend.aclose()
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    assert seen["HostConfig"]["Memory"] == 512 << 20
    assert "task asks memory = 64G; capped at [sandbox.docker] memory = 512m" in fin.details


async def test_agent_timeout_from_task_toml(sandbox, tmp_path):
    _backend, run = sandbox
    toml = (HARBOR / "greeting" / "task.toml").read_text().replace("timeout_sec = 120.0", "timeout_sec = 2.0")
    task = harbor_task(tmp_path, "greeting", toml=toml, solve="#!/usr/bin/env bash\ngreet world > out.txt\nsleep 60\n")
    fin = await run("oracle", task, timeout_s=120.0)
    # killed at the task's 2 s, the workspace is still scored
    assert (fin.status, fin.reward) == ("timeout", 1.0), fin.details
    assert "harness killed after 2s (task " in fin.details and "[agent] timeout_sec)" in fin.details


# ------------------------------------------------------------------------------------------ image cache
async def test_task_image_is_built_once_per_content(sandbox, tmp_path):
    backend, _run = sandbox
    nonce = uuid.uuid4().hex
    task = harbor_task(tmp_path, "greeting", files={"environment/app/nonce.txt": nonce})
    first = await backend.task_images.resolve(task)
    again = await backend.task_images.resolve(harbor_task(tmp_path, "greeting",
                                                          files={"environment/app/nonce.txt": nonce}))
    changed = await backend.task_images.resolve(harbor_task(tmp_path, "greeting",
                                                            files={"environment/app/nonce.txt": nonce + "x"}))
    assert first.built and not again.built and changed.built
    assert again.ref == first.ref and again.image_id == first.image_id and changed.ref != first.ref
    assert (first.workspace / "nonce.txt").read_text() == nonce and (first.workspace / "README.md").is_file()
    await anyio.run_process(["docker", "rmi", first.ref, changed.ref])  # images no other run will use again


async def test_missing_base_image_is_a_clear_error(sandbox, tmp_path):
    backend, run = sandbox
    missing = harbor_task(tmp_path, "greeting", dockerfile="FROM bridle-no-such-base:1\nWORKDIR /app\n")
    fin = await run("oracle", missing)
    assert fin.status == "sandbox_error"
    assert "bridle-no-such-base:1" in fin.details and "docker load" in fin.details and "line 1" in fin.details
    # mapped to a local image in [sandbox.docker] base_images, it builds
    backend.settings.base_images["bridle-no-such-base:1"] = "bridle-rootfs:bookworm"
    mapped = harbor_task(tmp_path, "greeting", dockerfile="FROM bridle-no-such-base:1\nWORKDIR /app\n",
                         solve="#!/usr/bin/env bash\necho hi > x\n")
    fin = await run("oracle", mapped, "r2")
    assert fin.status == "ok", fin.details
    # RUN steps have build_network; a step that needs the internet fails and says why
    offline = harbor_task(tmp_path, "greeting", dockerfile="FROM bridle-rootfs:bookworm\n"
                           "RUN apt-get update && apt-get install -y curl\n")
    fin = await run("oracle", offline, "r3")
    assert fin.status == "sandbox_error" and 'build_network = "none"' in fin.details, fin.details
    # an environment of several containers is refused, not half-run
    compose = harbor_task(tmp_path, "greeting", files={"environment/docker-compose.yaml": "services: {}\n"})
    fin = await run("oracle", compose, "r4")
    assert fin.status == "sandbox_error" and "docker-compose.yaml" in fin.details and "not supported" in fin.details


async def test_python_less_image_runs_the_oracle_but_refuses_a_harness(sandbox, tmp_path):
    _backend, run = sandbox
    dockerfile = ("FROM bridle-rootfs:bookworm\nRUN rm -f /usr/bin/python3* /usr/local/bin/python3*\n"
                  "COPY tools/greet /usr/local/bin/greet\nRUN chmod 0755 /usr/local/bin/greet && mkdir -p "
                  "/etc/greeting && echo 7f3a > /etc/greeting/salt\nENV GREETING_STYLE=shout\nWORKDIR /srv/project\n")
    task = harbor_task(tmp_path, "greeting", dockerfile=dockerfile)
    oracle = await run("oracle", task)
    assert (oracle.status, oracle.reward) == ("ok", 1.0), oracle.details
    whitebox = await run("whitebox", task, "r2")
    assert whitebox.status == "sandbox_error" and "has no python3" in whitebox.details, whitebox.details


# ------------------------------------------------------------------------------------------- verifier
APT_TEST_SH = """#!/usr/bin/env bash
# Harbor tasks often install their test tools first (apt-get update alone exits 0 without a network)
apt-get update && apt-get install -y curl || exit 1
echo 1 > /logs/verifier/reward.txt
"""
APT_SCORED_TEST_SH = """#!/usr/bin/env bash
mkdir -p /logs/verifier
if apt-get update && apt-get install -y curl; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


async def test_verifier_without_network_says_so(sandbox, tmp_path):
    _backend, run = sandbox
    failed = await run("oracle", harbor_task(tmp_path, "greeting", test_sh=APT_TEST_SH))
    assert failed.status == "verifier_error"
    assert "failed network lookup" in failed.details and 'verifier_network = "none"' in failed.details
    assert "deb.debian.org" not in failed.details  # bridle's words, never test.sh's output
    scored = await run("oracle", harbor_task(tmp_path, "greeting", test_sh=APT_SCORED_TEST_SH), "r2")
    assert (scored.status, scored.reward) == ("ok", 0.0)
    assert "its reward may be wrong" in scored.details
    plain = await run("oracle", harbor_task(tmp_path, "greeting", test_sh="#!/usr/bin/env bash\nexit 3\n"), "r3")
    assert plain.status == "verifier_error" and "failed network lookup" not in plain.details


# ------------------------------------------------------------------------------------------ gaming
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")


@pytest.fixture(scope="module")
def guarded_env(tmp_path_factory) -> Path:
    """The guarded fixture with pytest (from this test run's own environment) in its environment/pylib/."""
    dest = tmp_path_factory.mktemp("guarded") / "guarded"
    shutil.copytree(HARBOR / "guarded", dest)
    lib = dest / "environment" / "pylib"
    lib.mkdir()
    for name in PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        src = Path(spec.origin)
        if src.name == "__init__.py":
            shutil.copytree(src.parent, lib / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, lib / src.name)
    assert (lib / "pytest").is_dir() and (lib / "_pytest").is_dir()
    return dest


FORCE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
# What an agent may leave in the workspace to turn a wrong answer into a pass. Each writes the wrong answer 41.
ATTACKS = {
    "conftest": {"conftest.py": FORCE_PASS},
    "shadow": {"pytest.py": "import sys\nsys.exit(0)\n"},
    "plugin": {"evilplug.py": FORCE_PASS,
               "evilplug-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evilplug\nVersion: 1.0\n",
               "evilplug-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evilplug\n"},
    "path": {"bin/python3": "#!/bin/sh\nexit 0\n", "python3": "#!/bin/sh\nexit 0\n",
             ".bashrc": "export PATH=/app/bin:$PATH\n", ".profile": "export PATH=/app/bin:$PATH\n",
             ".bash_profile": "export PATH=/app/bin:$PATH\n", "sitecustomize.py": "import os\nos._exit(0)\n",
             "usercustomize.py": "import os\nos._exit(0)\n"},
}


def attack_solve(files: dict[str, str]) -> str:
    lines = ["#!/usr/bin/env bash", "set -e", "echo 41 > answer.txt"]
    for rel, text in files.items():
        lines += [f"mkdir -p \"$(dirname '{rel}')\"", f"cat > '{rel}' <<'BRIDLE_EOF'", text.rstrip("\n"), "BRIDLE_EOF"]
        if rel.endswith("python3"):
            lines.append(f"chmod +x '{rel}'")
    return "\n".join(lines) + "\n"


def guarded_task(tmp: Path, env: Path, solve: str | None = None, verifier_env: str = "") -> Task:
    dest = tmp / f"guarded-{uuid.uuid4().hex[:8]}"
    shutil.copytree(env, dest)
    if solve is not None:
        (dest / "solution" / "solve.sh").write_text(solve)
    if verifier_env:
        with (dest / "task.toml").open("a") as f:
            f.write(f"\n[verifier.env]\n{verifier_env}\n")
    return load_task(dest)


async def test_workspace_cannot_change_what_the_tests_run(sandbox, tmp_path, guarded_env):
    """conftest.py, a module shadowing pytest, a pytest plugin registered through a dist-info folder, a fake
    python3 and shell profiles changing PATH: none turns the wrong answer into a pass. The controls show the attacks
    are real: with PYTHONSAFEPATH cleared (the task's own [verifier] env may do so), the shadowing module and the
    plugin win."""
    _backend, run = sandbox
    cases = {"honest": guarded_task(tmp_path, guarded_env)}
    cases.update({name: guarded_task(tmp_path, guarded_env, attack_solve(files)) for name, files in ATTACKS.items()})
    for name in ("shadow", "plugin"):
        cases[f"{name}-unprotected"] = guarded_task(tmp_path, guarded_env, attack_solve(ATTACKS[name]),
                                                    verifier_env='PYTHONSAFEPATH = ""')
    results: dict[str, RolloutFinished] = {}
    limiter = anyio.Semaphore(3)

    async def one(name: str, task: Task) -> None:
        async with limiter:
            results[name] = await run("oracle", task, name)

    async with anyio.create_task_group() as tg:
        for name, task in cases.items():
            tg.start_soon(one, name, task)
    got = {name: (fin.status, fin.reward) for name, fin in results.items()}
    assert got == {"honest": ("ok", 1.0), "conftest": ("ok", 0.0), "shadow": ("ok", 0.0), "plugin": ("ok", 0.0),
                   "path": ("ok", 0.0), "shadow-unprotected": ("ok", 1.0), "plugin-unprotected": ("ok", 1.0)}, \
        {n: f.details for n, f in results.items()}


# --------------------------------------------------------------------------------- a harness on top
@pytest.mark.harness
async def test_black_box_harness_on_the_task_image(images, tmp_path):
    """Codex, laid over the task's image: the demonstration (the task's own tool, `greet`, through Codex's shell)
    scores 1, and so does one played from solution/solve.sh alone (a standard Harbor task: no actions.json); a
    policy that does nothing scores 0; the task's image is not changed."""
    from pipeline.rollout.images import ImageError, build_all

    try:
        build_all(("codex",))
    except ImageError as e:
        require(False, f"cannot build the codex image: {e}")
    task = harbor_task(tmp_path, "greeting")
    plain = harbor_task(tmp_path, "greeting")
    (plain.root / "solution" / "actions.json").unlink()
    plain = load_task(plain.root)
    assert [a.tool for a in plain.oracle_actions] == ["bash"] and "greet world" in plain.oracle_actions[0].args["command"]
    sock = tmp_path / "proxy.sock"
    backend = backend_for(tmp_path)
    await backend.start()
    before = await backend.task_images.resolve(task)
    finished = {}
    def scripted(t: Task) -> Script:
        return Script(default=msgspec.convert(oracle_script(t, "codex"), list[ScriptResponse]))

    for name, script, t in (("demo", scripted(task), task), ("solve", scripted(plain), plain),
                            ("idle", Script(default=[ScriptResponse(text="Done.")]), task)):
        async with running_proxy(script, unix_socket=str(sock)) as (proxy, records, _):
            req = request("codex", t, name, timeout_s=240)
            proxy.register(req)
            finished[name] = await backend.run(req, t, proxy_url=proxy.base_url, proxy_socket=str(sock))
            finished[name + "-calls"] = sum(type(r).__name__ == "ModelCall" for r in records)
    after = await backend.task_images.resolve(task)
    await backend.aclose()
    demo, idle = finished["demo"], finished["idle"]
    assert (demo.status, demo.reward) == ("ok", 1.0), demo.details
    assert (finished["solve"].status, finished["solve"].reward) == ("ok", 1.0), finished["solve"].details
    assert (idle.status, idle.reward) == ("ok", 0.0), idle.details
    assert finished["demo-calls"] >= 2 and finished["idle-calls"] >= 1
    assert after.image_id == before.image_id and not after.built
    assert containers_of(backend.run_id) == []


# --------------------------------------------------------------------------------------- oracle check
def test_oracle_check_command(images, tmp_path):
    """`python -m pipeline.rollout.oracle_check` over a folder: a table, then each failing task's whole verdict; a
    verifier that failed offline named as such; test.sh's output on request; base images mapped; exit 1 while one
    oracle scores 0."""
    import subprocess
    import sys

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copytree(HARBOR / "greeting", tasks / "greeting")
    shutil.copytree(HARBOR / "greeting", tasks / "greeting-wrong")
    (tasks / "greeting-wrong" / "solution" / "solve.sh").write_text("echo nope > out.txt\n")
    shutil.copytree(HARBOR / "greeting", tasks / "greeting-offline")
    (tasks / "greeting-offline" / "tests" / "test.sh").write_text(APT_SCORED_TEST_SH)
    shutil.copytree(HARBOR / "greeting", tasks / "greeting-ubuntu")  # FROM an image this machine lacks
    dockerfile = tasks / "greeting-ubuntu" / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("ARG BASE=bridle-rootfs:bookworm",
                                                         "ARG BASE=bridle-test/ubuntu:24.04"))
    argv = [sys.executable, "-m", "pipeline.rollout.oracle_check", str(tasks), "--verifier-network", "none",
            "--build-network", "none", "--base-image", "bridle-test/ubuntu:24.04=bridle-rootfs:bookworm",
            "--show-output"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    end = next(i for i, line in enumerate(lines) if "oracle solutions scored 1" in line)
    rows = {line.split()[0]: line.split()[1:4] for line in lines[1:end]}
    assert {k: v[:2] for k, v in rows.items() if k != "greeting-offline"} == {
        "greeting": ["ok", "1"], "greeting-wrong": ["ok", "0"], "greeting-ubuntu": ["ok", "1"]}, p.stdout
    assert rows["greeting-offline"] == ["ok", "offline?", "0"], p.stdout
    assert lines[end] == ("2 of 4 oracle solutions scored 1; 1 verifier(s) failed offline (rerun with "
                          "--verifier-network bridge)")
    # each failing task's whole verdict, and the start of its test.sh output (here apt's failed lookup)
    section = p.stdout[p.stdout.index("== greeting-offline: ok, reward 0"):]
    assert "its reward may be wrong" in section and "-- test.sh output (start):" in section
    assert "deb.debian.org" in section or "Temporary failure" in section, section
    assert "== greeting-wrong: ok, reward 0" in p.stdout and "== greeting:" not in p.stdout
    for name in ("greeting-wrong", "greeting-offline"):
        shutil.rmtree(tasks / name)
    assert subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False).returncode == 0
