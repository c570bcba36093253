"""What a harness may do inside its Docker sandbox, checked from inside a live container and with docker inspect:
non-root, no capabilities, read-only root, tmpfs /tmp and HOME, ulimits, the workspace's size cap, and the
emergency stop of a second Ctrl-C. Required in CI (harness_images/ci_setup.sh starts dockerd)."""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest

from pipeline.core.runtime import emergency_stop
from pipeline.messages import RolloutRequest
from pipeline.rollout.sandbox import DockerBackend, DockerSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.sandbox.hardening import CONTAINER_HOME
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import EnvironmentSection, Task, materialize
from tests.helpers.docker import OFFLINE, containers_of
from tests.helpers.poll import until
from tests.helpers.proxyutil import running_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

# The stand-in harness (the oracle pseudo-harness running this as solve.sh) probes what it may do, writes the
# answers to /app/report.json, and waits for the test to say "go" (so that the container can be inspected live).
PROBE = r"""
try() { if "$@" 2>/dev/null; then echo ok; else echo denied; fi; }
head -c 3M /dev/zero > /app/big 2>/dev/null; big_rc=$?
cat > /app/report.json <<EOF
{"uid": "$(id -u)", "gid": "$(id -g)", "home": "$HOME",
 "root": "$(try touch /x)", "etc": "$(try touch /etc/x)", "opt": "$(try touch /opt/bridle/x)",
 "usr": "$(try mkdir /usr/local/x)", "tmp": "$(try touch /tmp/x)", "home_write": "$(try touch "$HOME/x")",
 "home_fs": "$(stat -f -c %T "$HOME")", "tmp_fs": "$(stat -f -c %T /tmp)",
 "big_rc": $big_rc, "big_size": $(stat -c %s /app/big),
 "cap_eff": "$(grep CapEff /proc/self/status | cut -f2)", "core": "$(ulimit -c)", "nofile": "$(ulimit -n)",
 "no_new_privs": "$(grep NoNewPrivs /proc/self/status | cut -f2)"}
EOF
while [ ! -e /app/go ]; do sleep 0.1; done
echo after the failed write, the run went on > /app/done.txt
"""


def request(task: Task, timeout_s: float = 120.0, rid: str = "r1") -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id=task.id, harness="oracle",
                          token="tok", policy_version=0, timeout_s=timeout_s)


def stand_in(tmp: Path, name: str, solve: str, storage: str | None = None) -> Task:
    spec = generate("create_file", 0)
    config = msgspec.structs.replace(spec.config, environment=EnvironmentSection(storage=storage))
    spec = msgspec.structs.replace(spec, config=config, solution={"solve.sh": "#!/usr/bin/env bash\n" + solve})
    return materialize(spec, tmp / name)


async def inspect(cid: str) -> dict:
    return json.loads((await anyio.run_process(["docker", "inspect", cid])).stdout)[0]


async def test_the_harness_runs_confined_and_goes_on_after_a_refused_write(images, tmp_path):
    work = tmp_path / "work"
    backend = DockerBackend(DockerSettings(**OFFLINE, file_size="1m", open_files=1024, tmp_size="32m", home_size="16m", network="host"), common=SandboxCommon(workdir=str(work)))
    await backend.start()
    task = stand_in(tmp_path, "probe", PROBE)
    seen: dict = {}

    async def observe() -> None:
        report = await until(lambda: next(work.glob("bridle-*/app/report.json"), None), timeout_s=120)
        await anyio.sleep(0.2)  # the heredoc is written whole by then
        seen["report"] = json.loads(report.read_text())
        app = report.parent
        seen["app"] = app.stat()
        seen["app_entries"] = [p.lstat() for p in app.rglob("*")]
        (cid,) = containers_of(backend.run_id, running_only=True)
        seen["info"] = await inspect(cid)
        (app / "go").touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(observe)
        fin = await backend.run(request(task), task, proxy_url="http://127.0.0.1:9")
    await backend.aclose()
    assert fin.status == "ok", fin.details  # it exited 0 after the refused write: the verifier ran (reward 0)
    uid, gid = backend.user
    assert uid != 0
    r = seen["report"]
    assert (int(r["uid"]), int(r["gid"]), r["home"]) == (uid, gid, CONTAINER_HOME)
    assert (r["root"], r["etc"], r["opt"], r["usr"]) == ("denied",) * 4, r
    assert (r["tmp"], r["home_write"], r["home_fs"], r["tmp_fs"]) == ("ok", "ok", "tmpfs", "tmpfs"), r
    assert (r["big_rc"], r["big_size"]) == (128 + 25, 1 << 20), r  # SIGXFSZ at RLIMIT_FSIZE
    assert (r["cap_eff"], r["core"], r["nofile"], r["no_new_privs"]) == ("0000000000000000", "0", "1024", "1"), r

    info = seen["info"]
    hc = info["HostConfig"]
    assert info["Config"]["User"] == f"{uid}:{gid}"
    assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd") and hc["Privileged"] is False
    assert hc["ReadonlyRootfs"] is True and "no-new-privileges" in hc["SecurityOpt"]
    assert set(hc["Tmpfs"]) == {"/tmp", CONTAINER_HOME}
    assert "size=33554432" in hc["Tmpfs"]["/tmp"] and "size=16777216" in hc["Tmpfs"][CONTAINER_HOME]
    assert {u["Name"]: u["Hard"] for u in hc["Ulimits"]} == {"fsize": 1 << 20, "nofile": 1024, "core": 0}
    s = backend.settings
    assert hc["Memory"] == hc["MemorySwap"] == 2 << 30 and hc["PidsLimit"] == s.pids
    assert hc["NanoCpus"] == int(s.cpus * 1e9)

    # On the host the workspace belongs to the container's uid and is not world-writable.
    for st in [seen["app"], *seen["app_entries"]]:
        assert not st.st_mode & stat.S_IWOTH or stat.S_ISLNK(st.st_mode)
        if os.geteuid() == 0:
            assert (st.st_uid, st.st_gid) == (uid, gid)
    assert list(work.iterdir()) == []


async def test_network_none_still_reaches_the_proxy_as_non_root(images, tmp_path):
    """The forwarder binds 127.0.0.1:8080 and connects to the mounted socket as the unprivileged uid."""
    sock = tmp_path / "proxy.sock"
    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(tmp_path / "work"), keep_workspaces=True))
    await backend.start()
    solve = ("python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8080/health\","
             " timeout=5).status)' > /app/health.txt\n")
    task = stand_in(tmp_path, "health", solve)
    async with running_proxy(unix_socket=str(sock)) as (proxy, _, _):
        fin = await backend.run(request(task), task, proxy_url=proxy.base_url, proxy_socket=str(sock))
    await backend.aclose()
    assert fin.status == "ok", fin.details
    (kept,) = (tmp_path / "work").iterdir()
    assert (kept / "app" / "health.txt").read_text().strip() == "200"
    assert stat.S_IMODE((kept / "home").stat().st_mode) == 0o700  # the kept HOME, bind-mounted


@pytest.mark.parametrize("watch", ["while it runs", "after it ended"])
async def test_a_workspace_over_the_tasks_storage_is_sandbox_error(images, tmp_path, watch):
    # 12 files of 2 MiB (each within RLIMIT_FSIZE = the 16 MiB cap) make 24 MiB.
    fill = "for i in $(seq 1 12); do head -c 2M /dev/zero > /app/f$i; done\n"
    if watch == "while it runs":
        task, check_s = stand_in(tmp_path, "fill", fill + "sleep 600\n", storage="16m"), 0.2
    else:
        task, check_s = stand_in(tmp_path, "fill", fill, storage="16M"), 600.0
    backend = DockerBackend(DockerSettings(**OFFLINE, storage_check_s=check_s, network="host"), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await backend.start()
    # The harness would sleep out its 600 s: only the disk watch's kill ends it within the test's bound.
    with anyio.fail_after(150):
        fin = await backend.run(request(task, timeout_s=600), task, proxy_url="http://127.0.0.1:9")
    await backend.aclose()
    assert fin.status == "sandbox_error", fin.details
    held = re.search(r"the workspace \(/app\) holds ([\d.]+) MiB, over its size cap of 16.0 MiB", fin.details)
    assert held and 16 <= float(held.group(1)) <= 25, fin.details  # "16.0" when just over
    assert ("so it was stopped" in fin.details) == (watch == "while it runs"), fin.details
    assert "[environment] storage" in fin.details
    assert containers_of(backend.run_id) == [] and list((tmp_path / "work").iterdir()) == []


async def test_emergency_stop_removes_the_live_containers_at_once(images, tmp_path):
    """What a second Ctrl-C runs: synchronous (the event loop is abandoned), so nothing is left running."""
    backend = DockerBackend(DockerSettings(**OFFLINE, network="host"), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await backend.start()
    task = stand_in(tmp_path, "forever", "sleep 300\n")
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(partial(backend.run, request(task, rid=f"r{i}"), task, proxy_url="http://127.0.0.1:9"))
        await until(lambda: len(containers_of(backend.run_id, running_only=True)) == 2, timeout_s=120)
        await anyio.to_thread.run_sync(emergency_stop)
        assert containers_of(backend.run_id) == []
        assert list((tmp_path / "work").iterdir()) == []
        tg.cancel_scope.cancel()
    await backend.aclose()


async def test_start_removes_the_workspaces_a_crash_of_the_run_left(images, tmp_path):
    from pipeline.rollout.sandbox.util import rollout_dir

    work, run = tmp_path / "work", f"crashed-{uuid.uuid4().hex[:8]}"
    left = rollout_dir(str(work), run, "g00001-r0")
    (left / "app").mkdir()
    other = rollout_dir(str(work), f"{run}-2", "g00001-r0")
    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(work)), run_id=run)
    await backend.start()
    await backend.aclose()
    assert list(work.iterdir()) == [other]



async def test_a_bind_source_that_is_gone_fails_the_container_instead_of_becoming_a_root_owned_folder(images,
                                                                                                    tmp_path):
    """A container created as the run exits finds its proxy socket removed already; with the engine's ``Binds`` it
    would make a root-owned folder in its place (one was left in /tmp that way), with mounts the create fails."""
    import aiodocker

    from pipeline.rollout.harnesses import BASE_IMAGE

    backend = DockerBackend(DockerSettings(**OFFLINE), common=SandboxCommon(workdir=str(tmp_path / "work")))
    await backend.start()
    gone = tmp_path / "sock" / "proxy.sock"
    present = tmp_path / "present"
    present.mkdir()
    try:
        config = {"Image": BASE_IMAGE, "Cmd": ["true"], "Labels": backend._labels_for("r0", "harness"),
                  "HostConfig": backend._host_config([f"{present}:/p:ro", f"{gone}:/run/proxy.sock"], "none")}
        with pytest.raises(aiodocker.DockerError, match="does not exist"):
            await backend.docker.containers.create(config)
        assert not gone.exists() and not gone.parent.exists()
        # a source that exists is mounted, read-only where asked
        config["HostConfig"] = backend._host_config([f"{present}:/p:ro"], "none")
        config["Cmd"] = ["sh", "-c", "test -d /p && ! touch /p/x"]
        c = await backend.docker.containers.create(config)
        try:
            await c.start()
            assert (await c.wait())["StatusCode"] == 0
        finally:
            await c.delete(force=True)
    finally:
        await backend.aclose()


async def test_the_verifier_runs_in_a_fresh_container_that_nothing_of_the_harness_reaches(images, tmp_path):
    """The harness leaves a marker in its /tmp and a detached process behind; test.sh then records where it runs.
    Another container (host name), no harness process, an empty /tmp: only the workspace passes to the verifier."""
    solve = ("cat /proc/sys/kernel/hostname > /app/harness_host\n"
             "echo planted > /tmp/harness-was-here\n"
             "setsid sh -c 'exec sleep 333' > /dev/null 2>&1 < /dev/null &\n")
    task = stand_in(tmp_path, "fresh", solve)
    (task.tests_dir / "test.sh").write_text(
        "#!/usr/bin/env bash\n"
        "cat /proc/sys/kernel/hostname > /app/verifier_host\n"
        "ls /tmp > /app/verifier_tmp\n"
        "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' > /app/verifier_procs\n"
        "echo 1 > /logs/verifier/reward.txt\n")
    backend = DockerBackend(DockerSettings(**OFFLINE, network="host"), common=SandboxCommon(workdir=str(tmp_path / "work"), keep_workspaces=True))
    await backend.start()
    try:
        fin = await backend.run(request(task), task, proxy_url="http://127.0.0.1:9")
    finally:
        await backend.aclose()
    assert (fin.status, fin.reward) == ("ok", 1.0), fin.details
    (kept,) = (tmp_path / "work").iterdir()
    app = kept / "app"
    harness_host, verifier_host = ((app / n).read_text().strip() for n in ("harness_host", "verifier_host"))
    assert harness_host and verifier_host and harness_host != verifier_host
    assert "harness-was-here" not in (app / "verifier_tmp").read_text()
    assert "sleep 333" not in (app / "verifier_procs").read_text()
    assert "test.sh" in (app / "verifier_procs").read_text()  # the probe did see its own processes
    assert containers_of(backend.run_id) == []
