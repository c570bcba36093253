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
