"""Docker for the tests: is an engine there, which containers a run left."""

import shutil
import subprocess


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def containers_of(run_id: str, running_only: bool = False) -> list[str]:
    out = subprocess.run(["docker", "ps", "-q" if running_only else "-aq", "--filter", f"label=bridle.run={run_id}"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


# This machine's tests build task images and verify without network: their tasks need none ([sandbox.docker]
# build_network, verifier_network; users get "bridge", as Harbor gives).
OFFLINE = {"build_network": "none", "verifier_network": "none"}


def require_images() -> None:
    """A Docker engine and every sandbox image (built here when missing); fails in CI, skips on a laptop."""
    from pipeline.rollout.images import ImageError, build_all
    from tests.helpers.ci import require

    require(docker_available(), "no Docker engine (start dockerd; harness_images/ci_setup.sh does it)")
    try:
        build_all()
    except ImageError as e:
        require(False, f"cannot build the sandbox images: {e}")
