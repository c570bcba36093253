"""All 243 white-box configurations end to end: the real proxy (scripted engine), the local sandbox backend, a
built-in create_file task and its verifier. Each episode plays a per-rollout script (RolloutRequest.script) in
the configuration's tool names; the harness's transcript must show every realization of the configuration
(the script and the checks are in whitebox_scripts.py, shared with the Docker test).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from pipeline.messages import CallFailed, ModelCall
from pipeline.rollout.harness_space import HarnessConfig, all_configs
from pipeline.rollout.sandbox import LocalBackend, LocalSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import materialize
from tests.helpers.proxyutil import running_proxy
from tests.helpers.whitebox_scripts import HARNESS_ARGS, Outcome, check_outcome, episode, scripted_request

pytestmark = pytest.mark.slow

CONCURRENCY = 8
CONFIGS = all_configs()


def run_all(tmp: Path) -> dict[str, Outcome]:
    task = materialize(generate("create_file", 7), tmp / "task")
    common = SandboxCommon(workdir=str(tmp / "work"), keep_workspaces=True, whitebox_args=HARNESS_ARGS)
    outcomes: dict[str, Outcome] = {}

    async def main() -> None:
        backend = LocalBackend(LocalSettings(), common)
        await backend.start()
        limiter = anyio.CapacityLimiter(CONCURRENCY)
        async with running_proxy() as (proxy, records, _):

            async def one(config: HarnessConfig) -> None:
                steps = episode(config, task)
                req = scripted_request(config, task, steps)
                rid = req.rollout_id
                proxy.register(req)
                async with limiter:
                    fin = await backend.run(req, task, proxy_url=proxy.base_url, proxy_socket=proxy.unix_socket)
                (root,) = (tmp / "work").glob(f"bridle-*_{rid}-*")
                outcomes[config.name] = Outcome(
                    labels=[label for label, _ in steps], finished=fin,
                    calls=sorted((r for r in records if isinstance(r, ModelCall) and r.rollout_id == rid),
                                 key=lambda c: c.seq),
                    failed=[r for r in records if isinstance(r, CallFailed) and r.rollout_id == rid],
                    root=root,
                )

            async with anyio.create_task_group() as tg:
                for config in CONFIGS:
                    tg.start_soon(one, config)
        await backend.aclose()

    anyio.run(main)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    return run_all(tmp_path_factory.mktemp("whitebox_proxy"))


def test_every_configuration_ran(outcomes):
    assert sorted(outcomes) == sorted(c.name for c in CONFIGS) and len(outcomes) == 243


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_configuration_end_to_end(outcomes, config):
    check_outcome(outcomes[config.name], config)
