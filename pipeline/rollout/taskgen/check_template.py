"""Hidden checker copied verbatim into every generated task as ``tests/check.py`` (stdlib only, Python >= 3.10).

Usage: ``python3 -I -B check.py WORKSPACE VERIFIER_DIR``. Reads ``expected.json`` next to itself (a list of
checks), decides the reward and writes ``VERIFIER_DIR/reward.txt`` itself. Nothing that it or its child prints is
ever parsed as a verdict; the lines it prints (one per failed check) are for a person.

Trust: this process holds the expected values and never runs workspace code. A ``calls`` check (bugfix) imports
the workspace's module in a CHILD process that is told only the function names and arguments, starts in a private
read-only copy of the workspace (the workspace folder appended to ``sys.path``, so files there cannot shadow the
standard library), cannot fork, and reports the raw return values (JSON) on its stdout; this process compares
them with the expected values. When this process runs as root (the Docker verifier; the local one in CI), the child
runs as uid/gid 65534 and so cannot read ``tests/`` (0700) or ``logs/`` (0700) nor touch the reward; it never gets
a path to them in its environment, arguments or working folder. Workspace code can thus forge only its own return
values, which pays only if it computes the right ones, i.e. solves the task (held-out cases that are not in the
visible tests defeat a lookup table). The failure lines are printed only after every child has ended.

Workspace files are read without following symbolic links (a link is a failed check), so the checker never reads
or prints a file from outside the workspace.

Checks marked ``"partial": true`` also earn graded credit when they fail (a ``text`` check: the share of expected
words at their place). When not everything passes but some credit was earned, the reward is
``PARTIAL_CAP * mean credit`` (< 1, so only an exact solution reaches 1): a dense signal for small policies that
get the format right before the content.
"""

import configparser
import errno
import json
import os
import pathlib
import resource
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
PARTIAL_CAP = 0.8
CHILD_UID = 65534  # "nobody": the child's uid and gid when this checker runs as root
FILE_CAP = 16 << 20  # the largest workspace file a check reads
COPY_CAP = 256 << 20  # the most bytes of workspace the child's copy holds
RESULT_CAP = 4 << 20  # the most bytes the child may report

# The child: no standard-library shadowing (the workspace is appended to sys.path, '' and '.' removed before any
# import), stdout kept for the report and pointed at /dev/null for workspace code, every failure reported by name.
RUNNER = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import importlib, json, os
spec = json.loads(sys.argv[1])
report = os.fdopen(os.dup(1), "w", encoding="utf-8")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.chdir(spec["workspace"])
sys.path.append(spec["workspace"])
items = []
try:
    mod = importlib.import_module(spec["module"])
except BaseException as e:
    mod, why = None, "import failed: " + type(e).__name__
for name, args in spec["calls"]:
    try:
        if mod is None:
            raise RuntimeError(why)
        items.append(json.dumps({"value": getattr(mod, name)(*args)}))
    except BaseException as e:
        items.append(json.dumps({"error": why if mod is None else type(e).__name__}))
report.write("[" + ",".join(items) + "]")
report.flush()
os._exit(0)
"""


# ----------------------------------------------------------------------------------------- workspace files
def _open(ws, rel):
    """A descriptor of ``ws/rel`` opened without following any link below ``ws``; AssertionError otherwise."""
    parts = [p for p in pathlib.PurePosixPath(rel).parts if p not in ("", ".")]
    if any(p in ("..", "/") for p in parts):
        raise AssertionError(f"{rel}: not a path inside the workspace")
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                raise AssertionError(f"{rel} does not exist") from None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                    raise AssertionError(f"{rel} is a symbolic link or not a regular file") from None
                raise AssertionError(f"{rel}: cannot be opened ({e.strerror})") from None
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _kind(ws, rel):
    """'file', 'dir' or 'other' for ``ws/rel`` (no link followed); AssertionError when it cannot be opened."""
    fd = _open(ws, rel)
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def _read(ws, rel):
    fd = _open(ws, rel)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AssertionError(f"{rel} is not a regular file")
        if st.st_size > FILE_CAP:
            raise AssertionError(f"{rel} has {st.st_size} bytes, more than {FILE_CAP}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(FILE_CAP).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def _lines(text):
    return [ln.rstrip() for ln in text.rstrip("\n").split("\n")] if text.strip() else []


def credit(ws, c):
    """Graded credit in [0, 1] for a failed check marked partial."""
    if c["kind"] != "text":
        return 0.0
    try:
        got = _read(ws, c.get("path", "")).split()
    except AssertionError:
        return 0.0
    want = c["text"].split()
    if not want:
        return 0.0
    same = sum(1 for a, b in zip(got, want, strict=False) if a == b)
    return same / max(len(want), len(got))


# ------------------------------------------------------------------------------------------- file checks
def check_text(ws, c):
    rel = c["path"]
    got, want = _read(ws, rel), c["text"]
    if c.get("match") == "strip":
        got, want = got.strip(), want.strip()
    else:  # one trailing newline is allowed either way
        got, want = got.rstrip("\n"), want.rstrip("\n")
    if got != want:
        raise AssertionError(f"{rel}: content differs (got {got[:80]!r}, want {want[:80]!r})")


def check_lines(ws, c):
    got = _lines(_read(ws, c["path"]))
    if got != c["lines"]:
        raise AssertionError(f"{c['path']}: lines differ (got {got[:5]!r}..., want {c['lines'][:5]!r}...)")


def check_number(ws, c):
    rel = c["path"]
    raw = _read(ws, rel).strip()
    try:
        got = float(raw)
    except ValueError:
        raise AssertionError(f"{rel}: expected a number, got {raw[:40]!r}") from None
    if abs(got - c["value"]) > c.get("tol", 0.0) + 1e-9:
        raise AssertionError(f"{rel}: got {got}, want {c['value']}")


def check_absent(ws, c):
    try:
        _kind(ws, c["path"])
    except AssertionError as e:
        if str(e).endswith("does not exist"):
            return
        raise
    raise AssertionError(f"{c['path']} should not exist")


def check_dir(ws, c):
    if _kind(ws, c["path"]) != "dir":
        raise AssertionError(f"{c['path']}/ is not a directory")


def check_json(ws, c):
    try:
        got = json.loads(_read(ws, c["path"]))
    except json.JSONDecodeError as e:
        raise AssertionError(f"{c['path']}: not valid JSON ({e})") from None
    if got != c["value"]:
        raise AssertionError(f"{c['path']}: settings differ from what was asked")


def check_ini(ws, c):
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read_string(_read(ws, c["path"]))
    except configparser.Error as e:
        raise AssertionError(f"{c['path']}: not a valid INI file ({e})") from None
    if {s: dict(cp[s]) for s in cp.sections()} != c["value"]:
        raise AssertionError(f"{c['path']}: settings differ from what was asked")


# ------------------------------------------------------------------------------ workspace code, in a child
def _copy_tree(src, dst, budget):
    """Copy folders and regular files (opened without following links) of ``src`` into ``dst``, world-readable
    and owned by this process; links are recreated as they are (the child follows them with its own rights)."""
    for entry in os.scandir(src):
        s, d = os.path.join(src, entry.name), os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(s), d)
        elif entry.is_dir(follow_symlinks=False):
            os.mkdir(d, 0o755)
            budget = _copy_tree(s, d, budget)
        elif entry.is_file(follow_symlinks=False):
            budget = _copy_file(s, d, budget)
    return budget


def _copy_file(s, d, budget):
    fd = os.open(s, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > budget:
            return budget
        with open(d, "xb") as out:
            shutil.copyfileobj(f, out)
    os.chmod(d, 0o644)
    return budget - st.st_size


def _drop_privileges(limit_s):
    """In the child between fork and exec: another uid when root; no new processes; bounded CPU, memory, files."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(CHILD_UID)
        os.setuid(CHILD_UID)
    # After setuid: RLIMIT_NPROC 0 then makes every fork/clone of the child fail (no daemon outlives it).
    for res, value in ((resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, 1 << 20),
                       (resource.RLIMIT_CPU, int(limit_s) + 1), (resource.RLIMIT_AS, 2 << 30)):
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))


def _collect(proc, limit_s):
    """The child's stdout, at most RESULT_CAP bytes, within ``limit_s``; then the child is killed."""
    buf, fd = bytearray(), proc.stdout.fileno()
    deadline = time.monotonic() + limit_s
    try:
        while len(buf) <= RESULT_CAP:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return bytes(buf)


def _interpreter():
    """A Python the child may run: this one, unless it lies where uid 65534 cannot go (a venv or pyenv under
    /root), then the system's. Each candidate is tried once as the child would run it."""
    found = getattr(_interpreter, "found", None)
    if found is not None:
        return found
    candidates = [sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    for exe in dict.fromkeys(c for c in candidates if c and os.path.isfile(c)):
        try:
            ok = subprocess.run([exe, "-I", "-B", "-c", "import json"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, cwd="/",
                                preexec_fn=lambda: _drop_privileges(30),
                                check=False).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            _interpreter.found = exe
            return exe
    raise AssertionError("no Python interpreter that the checker's child process may run (uid 65534); install "
                         "python3 where every user can run it")


def run_child(ws, module, calls, limit_s):
    """The results of ``module.name(*args)`` for each call, computed by a child process (see the docstring):
    a list of ``{"value": ...}`` or ``{"error": ...}``, one per call."""
    copy = tempfile.mkdtemp(prefix="bridle-check-")
    try:
        os.chmod(copy, 0o755)
        _copy_tree(str(ws), copy, COPY_CAP)
        spec = json.dumps({"workspace": copy, "module": module, "calls": calls})
        proc = subprocess.Popen(
            [_interpreter(), "-I", "-B", "-c", RUNNER, spec], cwd=copy, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={"PATH": os.defpath, "LANG": "C.UTF-8"},
            start_new_session=True,
            preexec_fn=lambda: _drop_privileges(limit_s),  # noqa: PLW1509 - this checker runs no threads
        )
        raw = _collect(proc, limit_s)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    try:
        results = json.loads(raw.decode("utf-8")) if len(raw) <= RESULT_CAP else None
    except ValueError:
        results = None
    if not isinstance(results, list) or len(results) != len(calls) or not all(isinstance(r, dict) for r in results):
        return [{"error": "the child process gave no readable report"}] * len(calls)
    return results


def _same(case, result):
    if "value" not in result:
        return False
    # Both sides are plain JSON values here (no workspace object with its own __eq__): unittest's equality.
    got, want = result["value"], case["want"]
    if case.get("approx"):
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (got, want))
        return numbers and round(abs(got - want), 6) == 0  # assertAlmostEqual(places=6)
    return got == want


def check_calls(ws, c):
    cases = c["cases"]
    results = run_child(ws, c["module"], [[k["fn"], k["args"]] for k in cases], c.get("timeout_s", 30))
    wrong = [(k, r) for k, r in zip(cases, results, strict=True) if not _same(k, r)]
    if wrong:
        k, r = wrong[0]
        call = f"{k['fn']}({', '.join(json.dumps(a) for a in k['args'])})"[:120]
        how = f"raised or failed: {str(r['error'])[:80]}" if "error" in r else "returned a wrong value"
        raise AssertionError(f"{c['module']}: {len(wrong)} of {len(cases)} calls wrong; first: {call} {how}")


CHECKS = {"text": check_text, "lines": check_lines, "number": check_number, "absent": check_absent,
          "dir": check_dir, "json": check_json, "ini": check_ini, "calls": check_calls}


def check_one(ws, c):
    fn = CHECKS.get(c["kind"])
    if fn is None:
        raise AssertionError(f"unknown check kind {c['kind']!r}")
    fn(ws, c)


# ---------------------------------------------------------------------------------------------- verdict
def write_reward(verifier_dir, value):
    """``verifier_dir/reward.txt`` = ``value``, written atomically and through no link."""
    dfd = os.open(verifier_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        tmp = f".reward-{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
        with os.fdopen(fd, "w") as f:
            f.write(f"{value}\n")
        os.replace(tmp, "reward.txt", src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def verdict(ws, checks):
    """(reward as text, failure lines)."""
    failures, credits = [], []
    for c in checks:
        try:
            check_one(ws, c)
            credits.append(1.0)
        except Exception as e:  # noqa: BLE001 - any failure of the workspace is a failed check, reported by name
            failures.append(f"FAIL: {e}")
            credits.append(credit(ws, c) if c.get("partial") else 0.0)
    if not failures:
        return "1", failures
    if any(c.get("partial") for c in checks) and sum(credits) > 0:
        return f"{PARTIAL_CAP * sum(credits) / len(credits):.4f}", failures
    return "0", failures


def main():
    ws = pathlib.Path(sys.argv[1]).resolve()
    verifier_dir = pathlib.Path(sys.argv[2])
    expected = json.loads((HERE / "expected.json").read_text(encoding="utf-8"))
    reward, failures = verdict(ws, expected["checks"])
    write_reward(verifier_dir, reward)
    for line in failures:
        print(line)
    print(f"reward {reward}")


if __name__ == "__main__":
    main()
