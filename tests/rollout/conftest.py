import pytest

from tests.helpers.ci import require
from tests.helpers.docker import docker_available


@pytest.fixture(scope="module")
def images():
    require(docker_available(), "no Docker engine (start dockerd; harness_images/ci_setup.sh does it)")
    from pipeline.rollout.images import ImageError, build_all

    try:
        return build_all(("whitebox",))
    except ImageError as e:
        require(False, f"cannot build the sandbox images: {e}")
