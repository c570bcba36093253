"""Build the sandbox images offline: one idempotent call, ``build_all()`` (``python run.py --build-images``).

Images (tags in the adapters, :data:`pipeline.rollout.harnesses.HARNESSES`):

- ``bridle-rootfs:bookworm``: ``debootstrap --variant=minbase bookworm`` + python3, ``docker import``-ed. No
  image registry is needed, only a Debian mirror, once: the root filesystem tarball is cached under
  ``~/.cache/bridle/images`` and the image is skipped when its tag exists.
- ``bridle-base``: the root filesystem + ``/opt/bridle/forwarder.py`` (``harness_images/base``).
- ``bridle-whitebox``, ``bridle-claude-code``, ``bridle-codex``: one per harness, ``FROM bridle-base``. Claude
  Code and Codex ship native executables in their npm packages; they are installed on the host with npm (or taken
  from an existing ``node_modules``) and copied into the build context, so ``docker build`` runs offline.

Each image carries a ``bridle.key`` label: a hash of its Dockerfile, its inputs (small files by content, the large
executables by size and mtime) and its parent image id. A build is skipped when an image with that key exists, so calling this again is cheap.
Needs the ``docker`` CLI (and, for the root filesystem, ``debootstrap`` run as root).
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from pipeline.core.logs import get_logger
from pipeline.core.paths import HARNESS_IMAGES
from pipeline.rollout.harnesses import BASE_IMAGE
from pipeline.rollout.harnesses import HARNESSES as ADAPTERS

log = get_logger(component="images")

HERE = HARNESS_IMAGES
ROOTFS_TAG = "bridle-rootfs:bookworm"
BASE_TAG = BASE_IMAGE
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Kept small: bash + coreutils come with minbase; python3 runs the forwarder, the white-box harness and checkers.
ROOTFS_PACKAGES = ("python3", "ca-certificates", "procps")
# One image per harness that has one of its own (the oracle runs in the base image), from harness_images/<name>.
HARNESSES = tuple(h.name for h in ADAPTERS.values() if h.image and h.image != BASE_TAG)
NPM_PACKAGES = {h.name: h.npm_package for h in ADAPTERS.values() if h.name in HARNESSES and h.npm_package}


class ImageError(RuntimeError):
    pass


class BuiltImage(msgspec.Struct, kw_only=True):
    name: str
    tag: str
    built: bool  # False: an up-to-date image already existed
    size_mb: float = 0.0


def cache_dir() -> Path:
    return Path(os.environ.get("BRIDLE_CACHE", Path.home() / ".cache" / "bridle")) / "images"


def _run(argv: list[str], *, what: str, input_file: Path | None = None, timeout: float = 1800) -> str:
    try:
        stdin = input_file.open("rb") if input_file else subprocess.DEVNULL
        try:
            p = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, timeout=timeout,
                               check=False)
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
def npm_modules(npm_dir: str | Path | None = None) -> Path:
    """A ``node_modules`` holding Claude Code and Codex: ``npm_dir``, else the one above $BRIDLE_HARNESS_BIN,
    else ``~/.cache/bridle/images/npm/node_modules`` (``npm install`` there when missing)."""
    if npm_dir:
        p = Path(npm_dir)
        return p if p.name == "node_modules" else p / "node_modules"
    hb = os.environ.get("BRIDLE_HARNESS_BIN", "")
    if hb and Path(hb).parent.name == "node_modules" and Path(hb).parent.is_dir():
        return Path(hb).parent
    prefix = cache_dir() / "npm"
    modules = prefix / "node_modules"
    if not all((modules / spec.rsplit("@", 1)[0]).is_dir() for spec in NPM_PACKAGES.values()):
        if shutil.which("npm") is None:
            raise ImageError("npm is not installed; it is needed once to fetch Claude Code and Codex (or pass "
                             "npm_dir= / set BRIDLE_HARNESS_BIN to an existing node_modules/.bin)")
        prefix.mkdir(parents=True, exist_ok=True)
        log.info("npm_install", packages=list(NPM_PACKAGES.values()), prefix=str(prefix))
        _run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), *NPM_PACKAGES.values()],
             what="npm install")
    return modules


def harness_files(name: str, modules: Path) -> dict[str, Path]:
    """Build-context file name -> file on the host, for the images that carry an npm-installed executable."""
    if name == "claude-code":
        exe = modules / "@anthropic-ai" / "claude-code" / "bin" / "claude.exe"
        if not exe.is_file():
            raise ImageError(f"{exe} not found: this Claude Code package has no native executable; install "
                             f"{NPM_PACKAGES['claude-code']} (npm install runs its postinstall step)")
        return {"claude": exe}
    if name == "codex":
        arch = {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(platform.machine(), "")
        found = sorted(glob.glob(str(modules / "@openai" / "codex*" / "vendor" / f"{arch}-unknown-linux-musl")))
        if not found:
            raise ImageError(f"no Codex executable for {platform.machine()} under {modules}/@openai; install "
                             f"{NPM_PACKAGES['codex']} on a Linux host")
        vendor = Path(found[0])
        rg = vendor / "codex-path" / "rg"
        return {"codex": vendor / "bin" / "codex", "rg": rg if rg.is_file() else vendor / "path" / "rg"}
    return {}


# --------------------------------------------------------------------------------------------- builds
def _key(dockerfile: Path, inputs: dict[str, Path], parent_id: str) -> str:
    h = hashlib.sha256(dockerfile.read_bytes())
    h.update(parent_id.encode())
    for name, p in sorted(inputs.items()):
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
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_image(name: str, tag: str, context: Path, inputs: dict[str, Path], *, parent: str,
                force: bool = False) -> BuiltImage:
    """``docker build`` of ``context/Dockerfile`` plus ``inputs`` (linked into a temporary context) as ``tag``,
    skipped when an image with the same key exists."""
    parent_id = image_id(parent)
    if parent_id is None:
        raise ImageError(f"{name}: parent image {parent} is missing; build it first (build_all does)")
    files = context_files(context) | inputs
    key = _key(context / "Dockerfile", files, parent_id)
    if not force and image_label(tag, "bridle.key") == key:
        return BuiltImage(name=name, tag=tag, built=False, size_mb=image_size_mb(tag))
    with tempfile.TemporaryDirectory(prefix=f"bridle-ctx-{name}-", dir=cache_dir()) as tmp:
        for fname, src in files.items():
            _link_or_copy(src, Path(tmp) / fname)
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
    modules = npm_modules(npm_dir) if any(h in NPM_PACKAGES for h in harnesses) else None
    for h in harnesses:
        inputs = harness_files(h, modules) if modules is not None else {}
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
    p.add_argument("--npm-dir", default=None, help="a node_modules holding Claude Code and Codex")
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
