"""The Docker sandbox's confinement, without Docker: the container's HostConfig, the seed files, the workspace's
ownership and size. (tests/rollout/test_sandbox_docker_hardening.py checks the same against a live container.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rollout.sandbox import DockerBackend, DockerSettings
from pipeline.rollout.sandbox.base import SandboxError
from pipeline.rollout.sandbox.docker import DockerSandbox
from pipeline.rollout.sandbox.hardening import (
    BLOCK,
    SEED_EXEC,
    disk_usage,
    give_to,
    harness_host_config,
    over_limit,
    parse_user,
    write_seed,
)


def test_parse_user():
    assert parse_user("") == ((65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid()))
    for bad in ("0:0", "0:1000", "root", "1000", "1000:x", "-1:5", ":"):
        with pytest.raises(ValueError, match="non-root numeric"):
            parse_user(bad)
    if os.geteuid() == 0:
        assert parse_user("1000:1001") == (1000, 1001)


def test_host_config_confines_the_harness():
    hc = harness_host_config(user=(1234, 5678), home="/home/bridle", writable=("/var/cache/x",), tmp_bytes=1 << 20,
                             home_bytes=2 << 20, file_bytes=3 << 20, open_files=99)
    assert hc["CapDrop"] == ["ALL"] and hc["ReadonlyRootfs"] is True
    assert hc["Tmpfs"] == {
        "/tmp": "rw,nosuid,nodev,size=1048576,mode=1777",
        "/home/bridle": "rw,nosuid,nodev,uid=1234,gid=5678,mode=0700,size=2097152",
        "/var/cache/x": "rw,nosuid,nodev,uid=1234,gid=5678,mode=0700,size=1048576",
    }
    assert {u["Name"]: (u["Soft"], u["Hard"]) for u in hc["Ulimits"]} == {
        "fsize": (3 << 20, 3 << 20), "nofile": (99, 99), "core": (0, 0)}
    kept = harness_host_config(user=(1, 1), home="", writable=(), tmp_bytes=1, home_bytes=1, file_bytes=1,
                               open_files=1)
    assert list(kept["Tmpfs"]) == ["/tmp"]  # HOME is bind-mounted when workspaces are kept


def test_seed_files_land_where_the_launcher_put_them(tmp_path):
    seed, root = tmp_path / "seed", tmp_path / "root"
    files = {"/home/bridle/.codex/config.toml": "model = 1\n", "/tmp/i.md": "do it"}
    assert write_seed(files, seed, ("/home/bridle", "/tmp"))
    assert not write_seed({}, tmp_path / "none", ("/tmp",))
    for path in ("/etc/passwd", "/home/bridle/../../etc/x", "/home/bridlex/y"):
        with pytest.raises(ValueError, match="Harness.writable"):
            write_seed({path: ""}, tmp_path / "bad", ("/home/bridle", "/tmp"))
    # The container's copy step, pointed at a stand-in root: the same SEED_EXEC, with "/" replaced.
    code = SEED_EXEC.replace("t='/'+", f"t={str(root)!r}+'/'+")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(seed), "cat", f"{root}/tmp/i.md"],
                         capture_output=True, text=True, check=True).stdout
    assert out == "do it"
    assert (root / "home/bridle/.codex/config.toml").read_text() == "model = 1\n"


def test_give_to_leaves_nothing_world_writable(tmp_path):
    ws = tmp_path / "app"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f").write_text("x")
    (ws / "link").symlink_to("/etc/passwd")
    for p in (ws, ws / "sub", ws / "sub" / "f"):
        p.chmod(0o777)
    give_to(ws, os.getuid(), os.getgid())
    for p in (ws, ws / "sub", ws / "sub" / "f"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o775
    assert os.stat("/etc/passwd").st_mode & 0o777 == 0o644  # the link was not followed


def test_disk_usage_counts_blocks_entries_and_hard_links_once(tmp_path):
    base = disk_usage(tmp_path)
    assert base == max(os.lstat(tmp_path).st_blocks * 512, BLOCK)
    for i in range(100):
        (tmp_path / f"empty{i}").touch()
    assert disk_usage(tmp_path) == base + 100 * BLOCK  # empty files are not free
    big = tmp_path / "big"
    big.write_bytes(os.urandom(1 << 20))
    used = disk_usage(tmp_path)
    assert used == base + 100 * BLOCK + os.lstat(big).st_blocks * 512 >= base + 100 * BLOCK + (1 << 20)
    for i in range(3):
        os.link(big, tmp_path / f"hard{i}")
    assert disk_usage(tmp_path) == used
    (tmp_path / "out").symlink_to("/usr")  # not followed
    assert disk_usage(tmp_path) == used + BLOCK
    assert disk_usage(tmp_path / "missing") == 0


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 50_000), max_size=12), depth=st.integers(0, 3))
def test_disk_usage_is_at_least_du_and_the_bytes(tmp_path_factory, sizes, depth):
    root = tmp_path_factory.mktemp("du")
    d = root
    for i in range(depth):
        d = d / f"d{i}"
        d.mkdir()
    for i, n in enumerate(sizes):
        (d / f"f{i}").write_bytes(b"x" * n)
    du = int(subprocess.run(["du", "-s", "-B1", str(root)], capture_output=True, text=True,
                            check=True).stdout.split()[0])
    entries = 1 + depth + len(sizes)
    used = disk_usage(root)
    # Each entry counts max(its blocks, BLOCK): at least du, the bytes written and one block per entry, and at
    # most one block per entry more than du.
    assert max(du, sum(sizes), entries * BLOCK) <= used <= du + entries * BLOCK


def test_over_limit_names_the_folder_and_both_sizes(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * (3 << 20))
    assert over_limit([(tmp_path, 64 << 20, "the workspace (/app)")]) == ""
    msg = over_limit([(tmp_path, 1 << 20, "the workspace (/app)")])
    assert msg.startswith("the workspace (/app) holds 3.") and msg.endswith("over its size cap of 1.0 MiB")


def test_a_harness_file_outside_the_writable_folders_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"/opt/x/conf is not under a writable folder of the container \(/app, /tmp\)"):
        write_seed({"/opt/x/conf": "1"}, tmp_path / "seed", ("/app", "/tmp"))


@pytest.mark.anyio
async def test_a_container_gone_while_waited_on_is_sandbox_error_not_an_exception_group():
    """DockerBackend.wait runs the disk watch beside the wait: the wait's SandboxError must still come out bare,
    for the template to turn it into the status."""
    import aiodocker

    class Gone:
        id = "c0"

        async def wait(self):
            raise aiodocker.DockerError(404, {"message": "No such container: c0"})

    box = DockerSandbox(req=None, task=None, harness=None, variant="", proxy_url="", proxy_socket="",
                        container=Gone())
    with pytest.raises(SandboxError, match="disappeared"):
        await DockerBackend(DockerSettings(storage_check_s=60)).wait(box, 10)
