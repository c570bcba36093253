"""The 18 training configurations end to end in Docker: the real proxy on its Unix socket (scripted engine), the
Docker backend with network "none" (the harness reaches the proxy only through the mounted socket and the image's
forwarder), a built-in create_file task and its verifier container.

Each episode plays the same per-rollout script as the local test of all 243 configurations (whitebox_scripts.py)
and passes the same checks; the harness's transcript is copied out of the container (keep_workspaces). On top,
the prompts the policy was given (the proxy's ModelCalls, decoded) must show the configuration's tool names and
observation wrappers: what the transcript says the harness sent is what reached the policy.

Skipped on a machine without Docker; required in CI (harness_images/ci_setup.sh starts dockerd and builds images).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from pipeline.messages import CallFailed, ModelCall, ids
from pipeline.rollout.harness_space import HarnessConfig, offered_tools, training_configs
from pipeline.rollout.sandbox import DockerBackend, DockerSettings
from pipeline.rollout.sandbox.base import SandboxCommon
from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import materialize
from pipeline.tokens.tokenizer import QwenTokenizer
from tests.helpers.docker import OFFLINE, containers_of
from tests.helpers.proxyutil import running_proxy
from tests.helpers.whitebox_scripts import HARNESS_ARGS, Outcome, check_outcome, episode, scripted_request

pytestmark = pytest.mark.docker

CONCURRENCY = 6
CONFIGS = training_configs()
WRAPPERS = {1: "[sandbox-runner] job", 2: "--- execution metadata ---"}  # O1, O2: how observations start


def run_all(tmp: Path) -> tuple[dict[str, Outcome], DockerBackend]:
    task = materialize(generate("create_file", 7), tmp / "task")
    common = SandboxCommon(workdir=str(tmp / "work"), keep_workspaces=True, whitebox_args=HARNESS_ARGS)
    backend = DockerBackend(DockerSettings(**OFFLINE), common)
    outcomes: dict[str, Outcome] = {}

    async def main() -> None:
        await backend.start()
        limiter = anyio.CapacityLimiter(CONCURRENCY)
        try:
            async with running_proxy(unix_socket=str(tmp / "proxy.sock")) as (proxy, records, _):

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
        finally:
            await backend.aclose()

    anyio.run(main)
    return outcomes, backend


@pytest.fixture(scope="module")
def ran(images, tmp_path_factory) -> tuple[dict[str, Outcome], DockerBackend]:
    return run_all(tmp_path_factory.mktemp("whitebox_docker"))


def test_every_training_configuration_ran_isolated(ran):
    outcomes, backend = ran
    assert sorted(outcomes) == sorted(c.name for c in CONFIGS) and len(outcomes) == 18
    assert backend.settings.network == "none"
    assert containers_of(backend.run_id) == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_training_configuration_in_docker(ran, config):
    out = ran[0][config.name]
    check_outcome(out, config)

    # What the policy saw: the offered tools in the first prompt, observations wrapped as configured afterwards.
    tok = QwenTokenizer()
    prompts = [tok.decode(ids(c.input_ids)) for c in out.calls]
    assert all(f'"{name}"' in prompts[0] for name in offered_tools(config))
    for level, wrapper in WRAPPERS.items():
        assert wrapper not in prompts[0]
        assert any(wrapper in p for p in prompts[1:]) == (config.o == level)
