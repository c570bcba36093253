"""What a harness container may do, for the Docker backend (docs/rollout.md, "Sandboxes", says what holds).

A harness container runs as a non-root numeric ``uid:gid`` with every capability dropped and ``no-new-privileges``,
on a read-only root filesystem. It can write only to:

- ``/app``, the workspace, bind-mounted from the host and owned there by the container's uid (never world-writable);
  its size is capped by the task's ``[environment] storage``: RLIMIT_FSIZE bounds each file, and :func:`disk_usage`
  of the host folder is checked while the harness runs and once it has ended (the backend stops the harness and
  fails the rollout as ``sandbox_error`` above the cap);
- ``/tmp``, the harness's ``HOME`` (:data:`CONTAINER_HOME`) and what its adapter declares in ``Harness.writable``:
  size-capped tmpfs mounts (RAM, counted against the container's memory limit).

``StorageOpt size`` would cap only the container's own writable layer, which takes no writes on a read-only root
filesystem, so it is not used (and Docker accepts it only from overlay2 on xfs mounted with ``pquota``).

Files a harness's launcher writes before it starts (``Launch.files``: its config, an instruction file) are laid out
on the host under the rollout's ``seed/`` and copied to their places in the container by :func:`seeded` just
before the harness starts: ``docker cp`` into a read-only root filesystem is refused, and a tmpfs only exists once
the container runs.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path, PurePosixPath

CONTAINER_HOME = "/home/bridle"  # the harness's HOME (tmpfs; a bind mount of the rollout's home/ when kept)
SEED_MOUNT = "/run/bridle/seed"  # the rollout's seed/, read-only
BLOCK = 4096  # every file, folder and link counts as at least this much (a million empty files are not free)

# Run as ``python3 -S -c SEED_EXEC <seed folder> CMD ARGS...``: copy the seed folder's files to the same paths under
# "/", then become CMD. The folders it creates belong to the harness's uid.
SEED_EXEC = (
    "import os,shutil,sys\n"
    "src=sys.argv[1]\n"
    "for d,_,fs in os.walk(src):\n"
    " for f in fs:\n"
    "  p=os.path.join(d,f);t='/'+os.path.relpath(p,src)\n"
    "  os.makedirs(os.path.dirname(t),exist_ok=True);shutil.copyfile(p,t)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def parse_user(text: str) -> tuple[int, int]:
    """``"uid:gid"`` (numbers, uid not 0) -> (uid, gid); empty: the default, 65534:65534 (nobody) when bridle runs
    as root, else bridle's own uid and gid (a non-root bridle cannot hand the workspace to another uid)."""
    if not text:
        return (65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()) or int(uid) == 0:
        raise ValueError(f'[sandbox.docker] user: expected a non-root numeric "uid:gid" such as "1000:1000", '
                         f"got {text!r}")
    if os.geteuid() != 0 and int(uid) != os.getuid():
        raise ValueError(f"[sandbox.docker] user = {text!r}: bridle runs as uid {os.getuid()}, not root, so it "
                         "cannot give the workspace to another uid; leave user empty (= your own uid) or run as root")
    return int(uid), int(gid)


def harness_host_config(*, user: tuple[int, int], home: str, writable: tuple[str, ...], tmp_bytes: int,
                        home_bytes: int, file_bytes: int, open_files: int) -> dict:
    """The HostConfig fields that confine a harness container (added to the backend's limits, network, mounts).
    ``home``: a tmpfs at CONTAINER_HOME, or "" when the HOME is bind-mounted instead."""
    uid, gid = user
    owned = f"rw,nosuid,nodev,uid={uid},gid={gid},mode=0700"
    tmpfs = {"/tmp": f"rw,nosuid,nodev,size={tmp_bytes},mode=1777"}
    if home:
        tmpfs[home] = f"{owned},size={home_bytes}"
    for path in writable:
        tmpfs[path] = f"{owned},size={tmp_bytes}"
    return {
        "CapDrop": ["ALL"],
        "ReadonlyRootfs": True,
        "Tmpfs": tmpfs,
        # No nproc: RLIMIT_NPROC counts every process of the uid on the host (all sandboxes together);
        # PidsLimit bounds each container instead.
        "Ulimits": [{"Name": "fsize", "Soft": file_bytes, "Hard": file_bytes},
                    {"Name": "nofile", "Soft": open_files, "Hard": open_files},
                    {"Name": "core", "Soft": 0, "Hard": 0}],
    }


def write_seed(files: dict[str, str], seed: Path, writable: tuple[str, ...]) -> bool:
    """Lay out ``files`` (absolute container path -> content) under ``seed``; False when there are none. Raises
    ValueError for a path outside ``writable`` (the read-only root filesystem would refuse it at start)."""
    for path, content in files.items():
        p = PurePosixPath(path)
        if ".." in p.parts or not any(p.is_relative_to(w) for w in writable):
            raise ValueError(f"the harness's launch file {path} is not under a writable folder of the container "
                             f"({', '.join(writable)}); declare its folder in the adapter's Harness.writable")
        dest = seed / p.relative_to("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(content, encoding="utf-8")
    return bool(files)


def seeded(argv: list[str]) -> list[str]:
    """``argv``, preceded by the copy of the seed into place."""
    return ["python3", "-S", "-c", SEED_EXEC, SEED_MOUNT, *argv]


def give_to(path: Path, uid: int, gid: int) -> None:
    """Make everything under ``path`` the container user's (when bridle is root) and nothing world-writable."""
    chown = os.geteuid() == 0

    def fix(p: str) -> None:
        st = os.lstat(p)
        if chown:
            os.chown(p, uid, gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o002:
            os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o002)

    fix(str(path))
    for d, dirs, names in os.walk(path):
        for name in dirs + names:
            fix(os.path.join(d, name))


def disk_usage(path: Path) -> int:
    """Bytes ``path`` takes on disk as ``du`` counts them, except that every file, folder and link counts as at
    least :data:`BLOCK` and hard links once. Symlinks are not followed; what vanishes meanwhile is skipped."""
    try:
        total = max(os.lstat(path).st_blocks * 512, BLOCK)
    except OSError:
        return 0
    seen: set[tuple[int, int]] = set()
    stack = [str(path)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, BLOCK)
    return total


def over_limit(limits: list[tuple[Path, int, str]]) -> str:
    """Which of the (folder, size cap, what it is) holds more than its cap, in words; "" when none does."""
    for path, cap, what in limits:
        used = disk_usage(path)
        if used > cap:
            return f"{what} holds {used / 2**20:.1f} MiB, over its size cap of {cap / 2**20:.1f} MiB"
    return ""


def remove_containers_now(ids: list[str], docker_url: str = "", timeout_s: float = 10.0) -> None:
    """``docker rm -f`` the containers, synchronously: for a process that exits without running its event loop
    again. The docker CLI when installed (it finds the engine as the backend does), else the engine's Unix socket."""
    if not ids:
        return
    exe = shutil.which("docker")
    if exe:
        env = {**os.environ, "DOCKER_HOST": docker_url} if docker_url else None
        subprocess.run([exe, "rm", "-f", "-v", *ids], env=env, capture_output=True, timeout=timeout_s, check=False)
        return
    host = docker_url or os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        _unix_delete(host.removeprefix("unix://"), ids, timeout_s)


def _unix_delete(sock: str, ids: list[str], timeout_s: float) -> None:
    import http.client
    import socket

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(sock)

    for cid in ids:
        conn = Conn("localhost", timeout=timeout_s)
        try:
            conn.request("DELETE", f"/containers/{cid}?force=1&v=1")
            conn.getresponse().read()
        finally:
            conn.close()
