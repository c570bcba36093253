"""Hostile Harbor-format tasks whose ``solution/solve.sh`` plays the attacker, run by the oracle harness through the
local and the Docker backend: workspace code must not game the verifier nor leak host files into the run.

Each task is a built-in one (bugfix: hidden checks call workspace functions; create_file: a file check) with its
``solve.sh`` replaced. The attacks:

- (a) the module under test, imported by the verifier, hunts for the expected values (the checker's ``__main__``,
  ``BRIDLE_TESTS``, ``/tests``, its ancestors' argv and environment in ``/proc``, the visible tests), prints the
  old pass marker, writes ``reward.txt`` and answers from what it found; the bug is left in: reward must be 0;
- (b) the same module replaces ``logs/verifier/reward.txt`` by a symbolic link to a host file holding a random
  canary: reward 0 or verifier_error, the canary file unchanged and nowhere in the run directory;
- (c) the agent leaves workspace symbolic links to the canary file (as the answer file and beside it): the canary
  is not in the details, the event log, the run directory nor the rubric judge's workspace snapshot;
- (d) ``sitecustomize.py``, ``usercustomize.py``, ``conftest.py``, ``unittest.py``, ``json.py``, ``os.py``, a
  ``.pth`` file and ``python3`` / ``bash`` executables left in the workspace carry the attack of (a): reward 0;
- confinement: the fixed module plus a probe that breaks its import unless it runs without BRIDLE_* variables,
  without fork, and (as root, and in Docker) as uid 65534 unable to read tests/ or write logs/verifier/;
- honest: the task's own fix, with the module readable by its owner only and harmless shadowing files beside it,
  still scores 1.

"The run directory" here holds what a run keeps of a rollout: the event log with its RolloutFinished, the log lines
of the rollout, and the rollout's own directory (``keep_workspaces``). Every file there is searched, and the event
log also decoded.
"""

from __future__ import annotations

import json
import os
import shlex
import time
import uuid
from pathlib import Path

import anyio
import msgspec
import pytest
import structlog

from pipeline.core.eventlog import EventLogReader, EventLogWriter, LogHeader
from pipeline.messages import SCHEMA_VERSION, RolloutFinished, RolloutRequest
from pipeline.rollout.judge import workspace_snapshot
from pipeline.rollout.sandbox import DockerBackend, DockerSettings, LocalBackend, LocalSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import Task, TaskSpec, materialize
from tests.helpers.ci import require
from tests.helpers.docker import OFFLINE
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy

pytestmark = pytest.mark.anyio

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]

# The attack, appended to the module under test (bugfix), or planted as a shadowing module: runs at import.
ATTACK = r'''
import json as _j, os as _o, sys as _s

_CANARY = __CANARY__  # a host path: replace reward.txt by a link to it ("" = write reward 1 instead)
_LOOT = {}


def _ancestors():
    """argv and environment of the importing process's ancestors, as far as /proc shows them."""
    found, pid = [], _o.getppid()
    for _ in range(6):
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    found += [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            except OSError:
                pass
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return found


def _places():
    tests, logs = {"/tests"}, {"/logs/verifier"}
    main = _s.modules.get("__main__")
    for attr in ("HERE",):
        if getattr(main, attr, None) is not None:
            tests.add(str(getattr(main, attr)))
    if getattr(main, "__file__", None):
        tests.add(_o.path.dirname(_o.path.abspath(main.__file__)))
    words = _ancestors() + [f"{k}={v}" for k, v in _o.environ.items()]
    for w in words:
        key, _, val = w.partition("=")
        if key == "BRIDLE_TESTS":
            tests.add(val)
        if key == "BRIDLE_LOGS":
            logs.add(_o.path.join(val, "verifier"))
        if w.endswith("check.py"):
            tests.add(_o.path.dirname(w))
        if w.rstrip("/").endswith("verifier"):
            logs.add(w)
    return tests, logs


def _learn_assertions(path):
    import ast
    try:
        tree = ast.parse(open(path).read())
    except Exception:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith("assert") and len(node.args) >= 2:
            call = node.args[0]
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                try:
                    args = [ast.literal_eval(a) for a in call.args]
                    _LOOT[(call.func.id, _j.dumps(args))] = ast.literal_eval(node.args[1])
                except Exception:
                    pass


def _learn(tests):
    try:
        data = _j.load(open(_o.path.join(tests, "expected.json")))
    except Exception:
        data = {}
    for c in data.get("checks", []):
        for case in c.get("cases", []):
            _LOOT[(case["fn"], _j.dumps(case["args"]))] = case["want"]
    _learn_assertions(_o.path.join(tests, "hidden_test.py"))
    secret = data.get("secret")
    if secret is None:
        try:
            secret = open(_o.path.join(tests, "secret.txt")).read().strip()
        except Exception:
            pass
    if secret:
        print("BRIDLE-PASS " + secret, flush=True)


def _tamper(logs):
    try:
        target = _o.path.join(logs, "reward.txt")
        if _CANARY:
            tmp = target + ".link"
            _o.symlink(_CANARY, tmp)
            _o.replace(tmp, target)
        else:
            with open(target, "w") as f:
                f.write("1\n")
    except Exception:
        pass


def _wrap(name, f):
    def w(*a):
        key = (name, _j.dumps(list(a)))
        return _LOOT[key] if key in _LOOT else f(*a)
    return w


def _attack(ns):
    tests, logs = _places()
    for t in tests:
        _learn(t)
    for d in [_o.getcwd(), *_s.path]:
        try:
            for n in _o.listdir(d or "."):
                if n.startswith("test_") and n.endswith(".py"):
                    _learn_assertions(_o.path.join(d or ".", n))
        except Exception:
            pass
    for lg in logs:
        _tamper(lg)
    for k, v in list(ns.items()):
        if callable(v) and getattr(v, "__module__", None) == ns.get("__name__") and not k.startswith("_"):
            ns[k] = _wrap(k, v)


try:
    _attack(globals())
except Exception:
    pass
'''


def attack_source(canary: str = "") -> str:
    return ATTACK.replace("__CANARY__", repr(canary))


def with_solve(spec: TaskSpec, tmp: Path, name: str, solve: str) -> Task:
    """The task with its solution replaced by ``solve`` (bash, run in the workspace)."""
    script = '#!/usr/bin/env bash\nset -eu\ncd "${BRIDLE_WORKSPACE:-/app}"\n' + solve + "\n"
    return materialize(msgspec.structs.replace(spec, solution={"solve.sh": script}), tmp / name)


def write_file(path: str, text: str, mode: str = "644") -> str:
    """A bash line that writes ``text`` to ``path`` (relative to the workspace)."""
    return f"printf '%s' {shlex.quote(text)} > {shlex.quote(path)}; chmod {mode} {shlex.quote(path)}"


def bugfix_module(spec: TaskSpec) -> str:
    return next(p for p in spec.workspace if not p.startswith("test_"))


@pytest.fixture
def canary(tmp_path) -> tuple[Path, str]:
    """A host file only its owner can read, holding a random string."""
    text = f"CANARY-{uuid.uuid4().hex}"
    p = tmp_path / "host-secret.txt"
    p.write_text(text)
    p.chmod(0o600)
    return p, text


async def run_rollout(kind: str, task: Task, run_dir: Path, keep: bool = True) -> tuple[RolloutFinished, Path]:
    """One oracle rollout through ``kind``'s backend, kept like a run keeps it; returns it and its directory (with
    ``keep=False``: the folder the rollout folders go to, which the clean-up must leave empty)."""
    work = run_dir / "sandboxes"
    run_id = f"hostile-{uuid.uuid4().hex[:8]}"
    req = RolloutRequest(rollout_id="r1", group_id="g", index=0, group_size=1, task_id=task.id, harness="oracle",
                         token="tok", policy_version=0, timeout_s=120.0, task_path=str(task.root))
    with structlog.testing.capture_logs() as lines:
        if kind == "local":
            backend = LocalBackend(LocalSettings(), common=SandboxCommon(workdir=str(work), keep_workspaces=keep), run_id=run_id)
            await backend.start()
            try:
                fin = await backend.run(req, task, proxy_url="http://127.0.0.1:9")
            finally:
                await backend.aclose()
        else:
            sock = run_dir.parent / f"{run_id}.sock"
            backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(work), keep_workspaces=keep), run_id=run_id)
            await backend.start()
            try:
                async with running_proxy(unix_socket=str(sock)) as (proxy, _records, _token):
                    fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock))
            finally:
                await backend.aclose()
    with EventLogWriter(run_dir / "events.msgpack",
                        LogHeader(schema_version=SCHEMA_VERSION, run_id=run_id, created=time.time())) as w:
        w.append("sandbox.finished", fin)
    (run_dir / "log.jsonl").write_text("".join(json.dumps(x, default=str) + "\n" for x in lines))
    if not keep:
        return fin, work
    (kept,) = work.iterdir()
    return fin, kept


def assert_nowhere(needle: str, run_dir: Path, fin: RolloutFinished) -> None:
    """``needle`` is in no file under ``run_dir`` (links are not followed), nor in the decoded event log."""
    raw = needle.encode()
    assert needle not in fin.details, fin.details
    for dirpath, _dirs, files in os.walk(run_dir):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            assert raw not in p.read_bytes(), f"{needle} leaked into {p.relative_to(run_dir)}"
    for ev in EventLogReader(run_dir / "events.msgpack"):
        assert raw not in msgspec.json.encode(ev.msg), ev


@pytest.fixture
def backend_kind(request, tmp_path):
    kind = request.param
    if kind == "docker":
        request.getfixturevalue("images")
    return kind


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


def need_root_locally(kind: str) -> None:
    # As another user than root, the local verifier's child process runs as you and can read what you can (the
    # task's tests included); docs/rollout.md says so. CI runs as root.
    if kind == "local":
        require(os.geteuid() == 0, "the local verifier isolates workspace code only when it runs as root")


# ---------------------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_a_module_that_hunts_for_expected_values_scores_zero(backend_kind, tmp_path, run_dir):
    need_root_locally(backend_kind)
    spec = generate("bugfix", 3)
    module = bugfix_module(spec)
    task = with_solve(spec, tmp_path, "hunt", write_file(module, spec.workspace[module] + attack_source()))
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert (fin.status, fin.reward) == ("ok", 0.0), fin.details
    assert "BRIDLE-PASS" not in fin.details


# ---------------------------------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_b_reward_link_to_a_host_file_neither_scores_nor_leaks(backend_kind, tmp_path, run_dir, canary):
    need_root_locally(backend_kind)
    path, text = canary
    spec = generate("bugfix", 5)
    module = bugfix_module(spec)
    task = with_solve(spec, tmp_path, "link", write_file(module, spec.workspace[module] + attack_source(str(path))))
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert fin.status in ("ok", "verifier_error") and fin.reward == 0.0, fin.details
    assert path.read_text() == text, "the verifier wrote through the link into the host file"
    assert_nowhere(text, run_dir, fin)


# ---------------------------------------------------------------------------------------------------- (c)
@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_c_workspace_links_to_a_host_file_do_not_leak(backend_kind, tmp_path, run_dir, canary):
    path, text = canary
    spec = generate("create_file", 2)
    answer = json.loads(spec.solution["actions.json"])[0]["args"]["path"]
    q = shlex.quote
    solve = f"mkdir -p $(dirname {q(answer)}); ln -sf {q(str(path))} {q(answer)}; ln -s {q(str(path))} notes.txt"
    task = with_solve(spec, tmp_path, "wslink", solve)
    fin, kept = await run_rollout(backend_kind, task, run_dir)
    assert fin.status in ("ok", "verifier_error") and fin.reward == 0.0, fin.details
    assert_nowhere(text, run_dir, fin)
    snapshot = workspace_snapshot(kept / "app", 24_000, 4_000)
    assert "notes.txt" in snapshot and text not in snapshot, snapshot


# ---------------------------------------------------------------------------------------------------- (d)
SHADOWS = ("sitecustomize.py", "usercustomize.py", "conftest.py", "unittest.py", "json.py", "os.py")


@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_d_shadowing_files_and_executables_change_nothing(backend_kind, tmp_path, run_dir):
    need_root_locally(backend_kind)
    spec = generate("bugfix", 7)
    attack = attack_source()
    fake = "#!/bin/sh\necho BRIDLE-PASS; mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n"
    lines = [write_file(name, attack) for name in SHADOWS]
    lines += [write_file("zz-bridle.pth", "import sitecustomize\n"), write_file("python3", fake, "755"),
              write_file("bash", fake, "755"), write_file(".bashrc", "export PATH=/app:.:$PATH\n")]
    task = with_solve(spec, tmp_path, "shadow", "\n".join(lines))
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert (fin.status, fin.reward) == ("ok", 0.0), fin.details


# --------------------------------------------------------------------------------------------- confinement
CONFINED = r'''
import os as _o

def _confined():
    """What workspace code may not do when the checker imports it (the verdict is the reward: 1 only if so)."""
    assert not [k for k in _o.environ if k.startswith("BRIDLE")], _o.environ
    if __ROOT__:
        assert _o.getuid() == 65534 and _o.getgid() == 65534
    paths = ["/tests/expected.json", __TESTS__ + "/expected.json"]
    pid = _o.getppid()  # the checker: its argv names its own tests/ copy and logs/verifier/
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    check = next(a for a in argv if a.endswith("check.py"))
    paths.append(_o.path.join(_o.path.dirname(check), "expected.json"))
    for p in paths:
        try:
            open(p).read()
        except OSError:
            continue
        if __ROOT__:
            raise AssertionError(f"{p} is readable")
    for d in ("/logs/verifier", argv[-1]):
        try:
            open(_o.path.join(d, "reward.txt"), "w").write("1")
        except OSError:
            continue
        if __ROOT__:
            raise AssertionError(f"{d} is writable")
    try:
        pid = _o.fork()
    except OSError:
        return
    if pid == 0:
        _o._exit(0)
    raise AssertionError("fork worked")

_confined()
'''


@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_workspace_code_runs_confined(backend_kind, tmp_path, run_dir):
    """The fixed module plus a probe that breaks the import unless it is confined: reward 1 says it was."""
    root = backend_kind == "docker" or os.geteuid() == 0
    spec = generate("bugfix", 3)
    module = bugfix_module(spec)
    tests = tmp_path / "confined" / "tests"  # where with_solve puts the task's own tests/
    probe = CONFINED.replace("__ROOT__", repr(root)).replace("__TESTS__", repr(str(tests)))
    fix = spec.solution["solve.sh"].split("\n", 1)[1]
    task = with_solve(spec, tmp_path, "confined", f"{fix}\ncat >> {shlex.quote(module)} <<'EOF'\n{probe}\nEOF")
    assert task.tests_dir == tests
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details


# ------------------------------------------------------------------------------------------------ honest
@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_an_honest_fix_beside_shadowing_files_still_scores_one(backend_kind, tmp_path, run_dir):
    spec = generate("bugfix", 3)
    module = bugfix_module(spec)
    harmless = "raise SystemExit(3)\n"
    solve = spec.solution["solve.sh"].split("\n", 1)[1]  # the task's own fix, without its shebang line
    lines = [solve, f"chmod 600 {shlex.quote(module)}"]
    lines += [write_file(name, harmless) for name in SHADOWS]
    task = with_solve(spec, tmp_path, "honest", "\n".join(lines))
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details


# ------------------------------------------------------------------------------------- workspace, processes
DEEP_CHAIN = """python3 - <<'PY'
import os
for _ in range(2500):  # ~5,000 characters of path: past PATH_MAX, and past Python's recursion limit
    os.mkdir("d")
    os.chdir("d")
open("f", "w").write("x")
os.symlink("/", "root-link")  # the clean-up must not follow it
PY"""


@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_a_folder_chain_thousands_deep_neither_stops_the_run_nor_stays_behind(backend_kind, tmp_path, run_dir):
    task = with_solve(generate("create_file", 0), tmp_path, "deep", DEEP_CHAIN)
    fin, work = await run_rollout(backend_kind, task, run_dir, keep=False)
    assert (fin.status, fin.reward) == ("ok", 0.0), fin.details
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_a_process_that_leaves_the_session_and_the_environment_cannot_forge_the_reward(
        backend_kind, tmp_path, run_dir):
    """``setsid env -i``: out of the harness's process group and without the sandbox marker, it keeps writing reward 1
    where the verifier writes its reward. It must be dead before the verifier runs: reward 0, and nothing left."""
    need_root_locally(backend_kind)  # PID namespaces need root; elsewhere the backend warns at start-up
    tag = f"FORGER-{uuid.uuid4().hex}"
    loop = (f": {tag}; end=$(($(date +%s) + 30)); while [ $(date +%s) -lt $end ]; do "
            "for d in \"$0\"/logs/verifier /logs/verifier; do [ -d \"$d\" ] || mkdir -p \"$d\" 2>/dev/null; "
            "for i in 1 2 3 4 5 6 7 8 9 10; do printf 1 > \"$d/reward.txt\"; done 2>/dev/null; done; done")
    solve = f'setsid env -i sh -c {shlex.quote(loop)} "$(cd .. && pwd)" </dev/null >/dev/null 2>&1 &\nsleep 0.5'
    task = with_solve(generate("create_file", 0), tmp_path, "forge", solve)
    fin, _kept = await run_rollout(backend_kind, task, run_dir)
    assert (fin.status, fin.reward) == ("ok", 0.0), fin.details
    assert _running(tag) == []


def _running(tag: str) -> list[str]:
    """Processes whose command line holds ``tag``."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and tag.encode() in (p / "cmdline").read_bytes():
                found.append(p.name)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("backend_kind", BACKENDS, indirect=True)
async def test_a_kept_workspace_holds_no_setuid_or_setgid_file(backend_kind, tmp_path, run_dir):
    solve = "cp /bin/sh ./sh-suid && chmod 6755 ./sh-suid && mkdir d && chmod 2775 d && cp /bin/sh d/x && chmod 4755 d/x"
    task = with_solve(generate("create_file", 0), tmp_path, "suid", solve)
    fin, kept = await run_rollout(backend_kind, task, run_dir)
    assert fin.status == "ok", fin.details
    found = [p for p in kept.rglob("*") if not p.is_symlink() and p.lstat().st_mode & 0o6000]
    assert (kept / "app" / "sh-suid").exists() and found == []


SLOWLORIS = """python3 - <<'PY'
import socket, time
held = []
for _ in range(300):  # through the sandbox's forwarder to the proxy's socket
    try:
        s = socket.create_connection(("127.0.0.1", 8080), timeout=2)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n")
        held.append(s)
    except OSError:
        pass
end = time.time() + 12
while time.time() < end:  # a byte a second on every connection still open
    for s in list(held):
        try:
            s.sendall(b"X")
        except OSError:
            held.remove(s)
    time.sleep(1)
PY"""


@pytest.mark.docker
async def test_a_slowloris_from_inside_a_docker_sandbox_does_not_starve_a_good_client(images, tmp_path):
    import aiohttp

    sock = tmp_path / "proxy.sock"
    task = with_solve(generate("create_file", 0), tmp_path, "slowloris", SLOWLORIS)
    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(tmp_path / "work")), run_id="slowloris")
    await backend.start()
    req = RolloutRequest(rollout_id="bad", group_id="g", index=0, group_size=1, task_id=task.id, harness="oracle",
                         token="bad-token", policy_version=0, timeout_s=120.0, task_path=str(task.root))
    answered: list[int] = []
    finished: list[RolloutFinished] = []
    async with (running_proxy(unix_socket=str(sock), request_timeout_s=3.0, max_connections=64) as (proxy, _, token),
                anyio.create_task_group() as tg):

        async def hostile() -> None:
            finished.append(await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=str(sock)))

        tg.start_soon(hostile)
        await until(lambda: len(proxy.server.connections) >= 50, timeout_s=60)  # the attack is on
        peak = [0]

        async def watch() -> None:
            while not finished:  # until the hostile rollout ended
                peak[0] = max(peak[0], len(proxy.server.connections))
                await anyio.sleep(0.02)

        tg.start_soon(watch)
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            for _ in range(10):
                with anyio.fail_after(10):
                    async with s.post("http://proxy/v1/chat/completions",
                                      headers={"Authorization": f"Bearer {token}", "Connection": "close"},
                                      json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
                                      ) as r:
                        answered.append(r.status)
    await backend.aclose()
    assert answered == [200] * 10
    assert 50 <= peak[0] <= 64  # the 300 the sandbox opened were held to the cap
    assert finished and finished[0].status == "ok", finished
