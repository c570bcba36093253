"""The local sandbox backend: the harness as a child process of this one, in a temporary directory.

The harness runs in its own session and process group under POSIX rlimits, and is killed as a group and by an
environment marker (``BRIDLE_SANDBOX_RUN`` / ``BRIDLE_SANDBOX_ID``), so that even daemonized children die. Where
this process may create PID namespaces (root), the harness is also the first process of a namespace of its own
(``unshare --pid``): whatever it spawned, ``setsid`` with a cleared environment included, dies with it, before its
verifier runs. Elsewhere a process that leaves both the session and the marker survives the rollout, and
:meth:`LocalBackend.start` says so. It is convenient and the embedded default, but it is **no security boundary**:
the harness runs as your user and can read your files and reach the network. The verifier runs afterwards as a
process of its own (``pipeline/rollout/verify.py``). :meth:`LocalBackend.start` kills what a crash of this run
left (its marked processes, its rollout directories); a hard exit kills them through
:meth:`LocalBackend.emergency_stop`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.core.runfiles import kill_marked, remove_prefixed
from pipeline.core.runtime import on_emergency
from pipeline.rollout.harnesses import Launch, LaunchContext, find_binary
from pipeline.rollout.sandbox.base import (
    HarnessExit,
    Sandbox,
    SandboxBackend,
    SandboxCommon,
    SandboxError,
    Verdict,
    VerifierError,
)
from pipeline.rollout.sandbox.util import (
    HARNESS_OUTPUT,
    file_tail,
    keep_or_remove,
    parse_size,
    remove_run_dirs,
    rollout_dir,
    run_prefix,
)
from pipeline.rollout.sandbox.warm import WAIT_EXEC, write_go
from pipeline.rollout.tasks import seed_workspace
from pipeline.rollout.verify import run_verifier_local

log = get_logger(component="sandbox")

MARKER_RUN = "BRIDLE_SANDBOX_RUN"  # environment marker: which backend (run id) started the process
MARKER_ID = "BRIDLE_SANDBOX_ID"  # environment marker: which sandbox it belongs to


class LocalSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The local backend. Limits are POSIX rlimits on the harness process (inherited by its children)."""

    cpu_seconds: Annotated[int, msgspec.Meta(ge=1)] | None = None  # RLIMIT_CPU per process
    # RLIMIT_AS per process. Off by default: Node- and Bun-based harnesses reserve far more address space than
    # they use and fail to start under a small limit.
    memory: str | None = None
    file_size: str | None = "2g"  # RLIMIT_FSIZE: the largest file a harness may write
    open_files: int | None = 4096  # RLIMIT_NOFILE
    harness_bin: str = ""  # folder with the harness executables (default: $BRIDLE_HARNESS_BIN, then PATH)


    def problem(self, where: str) -> str:
        """What in these settings cannot work ("" when nothing): a size that does not parse or is 0."""
        for field in ("memory", "file_size"):
            value = getattr(self, field)
            try:
                if value is not None and not parse_size(value, f"{where} {field}"):
                    return f"{where} {field} = {value!r}: a size must be more than 0"
            except ValueError as e:
                return str(e)
        return ""


# Applied between fork and exec by a tiny Python wrapper (anyio's open_process has no preexec_fn).
_RLIMIT_EXEC = (
    "import json,os,resource,sys\n"
    "for k,v in json.loads(sys.argv[1]).items():\n"
    " r=getattr(resource,k);h=resource.getrlimit(r)[1]\n"
    " v=v if h==resource.RLIM_INFINITY else min(v,h)\n"
    " resource.setrlimit(r,(v,v))\n"
    "try:os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:sys.stderr.write(f'cannot run {sys.argv[2]!r}: {e}\\n');sys.exit(127)\n"
)


# The harness as the first process of a new PID namespace; unshare waits for it and exits with its status, and dies
# with it (--kill-child) if unshare itself is killed.
UNSHARE = ("unshare", "--pid", "--fork", "--kill-child")


def _pid_namespaces_work() -> bool:
    try:
        return subprocess.run([*UNSHARE, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


@dataclass
class _Slot:
    """A pooled process: started in its folder, waiting for go/go.json."""

    sandbox_id: str
    proc: Any
    root: Path
    out_path: Path


@dataclass(kw_only=True)
class LocalSandbox(Sandbox):
    sandbox_id: str = ""  # the value of MARKER_ID in the harness's environment
    proc: Any = None  # the harness process, once started
    out_path: Path | None = None  # the harness's stdout and stderr


class LocalBackend(SandboxBackend[LocalSandbox]):
    """Harness as a child process in a temporary directory. NOT a security boundary (see module docstring)."""

    kind = "local"
    sandbox_type = LocalSandbox

    def __init__(self, settings: LocalSettings | None = None, common: SandboxCommon | None = None, *,
                 run_id: str = ""):
        super().__init__(run_id=run_id)
        self.settings = s = settings or LocalSettings()
        self.common = common or SandboxCommon()
        self.memory_limit = s.memory
        self.keep_workspaces = self.common.keep_workspaces
        self._limits: dict[str, int] = {}
        for name, value in (
            ("RLIMIT_CPU", s.cpu_seconds),
            ("RLIMIT_AS", parse_size(s.memory, "memory")),
            ("RLIMIT_FSIZE", parse_size(s.file_size, "file_size")),
            ("RLIMIT_NOFILE", s.open_files),
            ("RLIMIT_CORE", 0),
        ):
            if value is not None:
                self._limits[name] = int(value)
        self._live: set[str] = set()
        self._pid_namespace = False  # start(): whether each harness gets a PID namespace of its own
        self._emergency = self.emergency_stop  # one bound method: on_emergency keys on its identity
        self._unregister: Callable[[], None] = lambda: None
        self._warm_from(self.common)

    async def start(self) -> None:
        """Kill this run's processes and remove its rollout directories, as a crash of it left them; from now on
        a hard exit (a second Ctrl-C) does the same (:meth:`emergency_stop`)."""
        n = kill_marked(f"{MARKER_RUN}={self.run_id}")
        dirs = len(remove_prefixed(tempfile.gettempdir(), self._verify_prefix))  # verifiers a kill -9 interrupted
        dirs += 0 if self.common.keep_workspaces else remove_run_dirs(self.common.workdir, self.run_id)
        if n or dirs:
            log.warning("reaped_leftovers", run=self.run_id, processes=n, workspaces=dirs)
        self._pid_namespace = await anyio.to_thread.run_sync(_pid_namespaces_work)
        if not self._pid_namespace:
            log.warning("local backend: a process that leaves the harness's session with a cleared environment "
                        "(setsid env -i) can outlive its rollout and touch the verifier's files; PID namespaces "
                        "need root here. Use the docker backend for policies you do not trust")
        self._unregister = on_emergency(self._emergency)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.pool is not None:
                await self.pool.aclose()
            await anyio.to_thread.run_sync(kill_marked, f"{MARKER_RUN}={self.run_id}")
        self._unregister()

    def emergency_stop(self) -> None:
        """Synchronously, for a process that exits without cleanup: kill every harness of this run (their own
        sessions would outlive us) and remove the rollout directories."""
        kill_marked(f"{MARKER_RUN}={self.run_id}")
        if not self.common.keep_workspaces:
            remove_run_dirs(self.common.workdir, self.run_id)

    @property
    def _verify_prefix(self) -> str:
        # "~" never appears in a rollout folder's name (rollout_dir): no rollout folder matches this prefix
        return f"{run_prefix(self.run_id)}~verify-"

    def _binary(self, executable: str) -> str:
        """The harness executable on this host ("" when not found): in harness_bin if set, else find_binary."""
        if self.settings.harness_bin:
            p = Path(self.settings.harness_bin) / executable
            return str(p) if p.exists() else ""
        return find_binary(executable) or ""

    # ------------------------------------------------------------------------------------------------ hooks
    async def prepare(self, box: LocalSandbox) -> None:
        if self.pool is not None and not box.harness.needs_solution:
            slot = await self.pool.take("local", None) or await self._make_warm("local", None)
            box.sandbox_id, box.proc, box.out_path, box.root = slot.sandbox_id, slot.proc, slot.out_path, slot.root
            self._live.add(slot.sandbox_id)
            await anyio.to_thread.run_sync(self._lay_out, box)
            return
        # In a worker thread: seeding the workspace copies files, which must not stall the other rollouts.
        await anyio.to_thread.run_sync(self._lay_out, box)

    def _lay_out(self, box: LocalSandbox) -> None:
        """The rollout's folder (a pooled one is renamed to the rollout's name first), the task's files and the
        harness's launch."""
        c, h, task = self.common, box.harness, box.task
        if box.root is None:
            box.sandbox_id = f"{self.run_id}.{uuid.uuid4().hex[:8]}"
            box.root = root = rollout_dir(c.workdir, self.run_id, box.req.rollout_id)
            for part in ("home", "logs"):
                (root / part).mkdir()
        else:
            root = rollout_dir(c.workdir, self.run_id, box.req.rollout_id)
            try:
                os.replace(box.root, root)  # onto the fresh empty folder; the waiting process's cwd follows it
            except OSError:
                root.rmdir()
                raise
            box.root = root
        ws, home, logs = root / "app", root / "home", root / "logs"
        seed_workspace(task, ws)
        box.out_path = logs / HARNESS_OUTPUT
        solution = ""
        if h.needs_solution:
            shutil.copytree(task.root / "solution", root / "solution")
            solution = str(root / "solution")
        binary = ""
        if h.executable:
            binary = self._binary(h.executable)
            if not binary:
                raise SandboxError(
                    f"{h.name} executable not found; install it (npm install {' '.join(h.npm_packages)}) and set "
                    "BRIDLE_HARNESS_BIN or LocalSettings.harness_bin to the node_modules/.bin folder"
                )
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=box.proxy_url.rstrip("/"),
                            token=box.req.token, instruction=task.instruction, model=c.model, max_turns=c.max_turns,
                            binary=binary, solution_dir=solution, whitebox_args=list(c.whitebox_args))
        box.launch = h.launch(ctx, box.variant)
        _write_files(box.launch)

    def _spawn_argv(self, argv: list[str]) -> list[str]:
        """``argv`` under the rlimits, in a PID namespace of its own where this host allows one."""
        argv = [sys.executable, "-S", "-c", _RLIMIT_EXEC, json.dumps(self._limits), *argv]
        return [*UNSHARE, *argv] if self._pid_namespace else argv

    async def _spawn(self, argv: list[str], cwd: Path, env: dict[str, str], sandbox_id: str, out_path: Path) -> Any:
        env = {"PATH": os.environ.get("PATH", os.defpath), **env, MARKER_RUN: self.run_id, MARKER_ID: sandbox_id}
        async with self.gate.slot():
            with out_path.open("wb") as out:
                proc = await anyio.open_process(self._spawn_argv(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._live.add(sandbox_id)
        return proc

    async def launch(self, box: LocalSandbox) -> None:
        assert box.launch is not None and box.root is not None and box.out_path is not None
        if box.proc is not None:  # a pooled process: its waiter becomes the harness
            await anyio.to_thread.run_sync(write_go, box.root / "go", box.launch.argv, box.launch.env)
            return
        try:
            box.proc = await self._spawn(box.launch.argv, box.root / "app", box.launch.env, box.sandbox_id,
                                         box.out_path)
        except OSError as e:
            raise SandboxError(f"could not start {box.launch.argv[0]}: {e}") from None

    # ------------------------------------------------------------------------------------------- warm pool
    async def _make_warm(self, key: Any, template: Any) -> _Slot:
        """A started process in a folder of its own (app/, home/, logs/, go/), waiting for its launch."""
        sandbox_id = f"{self.run_id}.{uuid.uuid4().hex[:8]}"
        root = await anyio.to_thread.run_sync(rollout_dir, self.common.workdir, self.run_id, "warm")
        try:
            for part in ("app", "home", "logs", "go"):
                (root / part).mkdir()
            out_path = root / "logs" / HARNESS_OUTPUT
            # go/ relative to its cwd (app/), which follows the folder when a rollout renames it
            proc = await self._spawn([sys.executable, "-S", "-c", WAIT_EXEC, "../go"], root / "app", {},
                                     sandbox_id, out_path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(kill_marked, f"{MARKER_ID}={sandbox_id}")
                await anyio.to_thread.run_sync(keep_or_remove, root, False)
            raise
        return _Slot(sandbox_id=sandbox_id, proc=proc, root=root, out_path=out_path)

    async def _warm_alive(self, slot: _Slot) -> bool:
        return slot.proc.returncode is None

    async def _destroy_warm(self, slot: _Slot) -> None:
        with anyio.CancelScope(shield=True):
            await self._kill(slot.proc, slot.sandbox_id)
            self._live.discard(slot.sandbox_id)
            await anyio.to_thread.run_sync(keep_or_remove, slot.root, False)

    async def wait(self, box: LocalSandbox, timeout_s: float) -> HarnessExit:
        with anyio.move_on_after(timeout_s) as scope:
            await box.proc.wait()
        # Also after a normal exit: background children it left behind must not outlive it.
        with anyio.CancelScope(shield=True):
            await self._kill(box.proc, box.sandbox_id)
        return HarnessExit(timed_out=scope.cancelled_caught, exit_code=box.proc.returncode)

    async def logs(self, box: LocalSandbox) -> str:
        return file_tail(box.out_path) if box.out_path is not None else ""

    async def verify(self, box: LocalSandbox) -> Verdict:
        assert box.root is not None
        vr = await run_verifier_local(box.task, box.root / "app", logs_dir=box.root / "logs",
                                      tmp_prefix=self._verify_prefix)
        if vr.status != "ok":  # test.sh's own output stays in logs/verifier/test-stdout.txt (keep_workspaces)
            raise VerifierError(vr.error)
        return Verdict(reward=vr.reward, rewards=vr.rewards, summary=vr.summary())

    async def cleanup(self, box: LocalSandbox) -> None:
        if box.proc is not None and box.proc.returncode is None:
            await self._kill(box.proc, box.sandbox_id)
        self._live.discard(box.sandbox_id)
        await anyio.to_thread.run_sync(keep_or_remove, box.root, self.common.keep_workspaces)

    async def _kill(self, proc: Any, sandbox_id: str) -> None:
        """SIGKILL the harness's PID namespace, its process group, then whatever left it, and reap the harness."""
        if self._pid_namespace and proc.returncode is None:
            # Killing the namespace's first process makes the kernel kill every other one in it; unshare exits
            # only once they are all gone, so waiting for it is waiting for the last of them.
            for pid in _children(proc.pid):
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with anyio.move_on_after(10):
                await proc.wait()
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Children that left the process group (setsid, daemonized servers) still carry the marker.
        await anyio.to_thread.run_sync(kill_marked, f"{MARKER_ID}={sandbox_id}")
        await proc.wait()


def _write_files(launch: Launch) -> None:
    for path, content in launch.files.items():
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content, encoding="utf-8")
