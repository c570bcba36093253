"""Markers: ``slow`` is everything a fast loop (``pytest -m "not slow"``) skips: the end-to-end runs in tests/e2e,
anything that needs Docker or a real harness binary, and the tests marked slow by hand (processes, big sweeps)."""

from pathlib import Path

import pytest

# its checks are asserts in a helper module: rewritten so their failures show the values
pytest.register_assert_rewrite("tests.helpers.whitebox_scripts")

# Task folders under data/ carry their own tests (Harbor's tests/test_outputs.py): the verifiers run them, not us.
collect_ignore_glob = ["data/*"]

E2E = Path(__file__).resolve().parent / "e2e"
FAST_E2E = {"test_reload.py"}  # in-process actors only


@pytest.fixture
def anyio_backend():
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        in_e2e = path.parent == E2E and path.name not in FAST_E2E
        if in_e2e or item.get_closest_marker("docker") or item.get_closest_marker("harness"):
            item.add_marker(pytest.mark.slow)
