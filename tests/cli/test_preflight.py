"""What a run needs from this machine is checked before it starts: each newcomer mistake fails early, named."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors import REGISTRY
from pipeline.cli.preflight import problems
from pipeline.core import config as cfg
from pipeline.core.runtime import make_resolver
from pipeline.models.small import create_small_model
from tests.helpers.ci import require
from tests.helpers.docker import docker_available

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / "tests" / "data" / "harbor"
resolve = make_resolver(REGISTRY)


def load(tmp_path, text, overrides=()):
    p = tmp_path / "mine.toml"
    p.write_text(text)
    return cfg.load_experiment(p, resolve, list(overrides))


def one(found: list[str], *parts: str) -> str:
    hits = [f for f in found if all(p in f for p in parts)]
    assert len(hits) == 1, found
    return hits[0]


def test_model_folder_engine_and_renderer(tmp_path):
    text = '[run]\nmodel = "/no/such/model"\n[proxy.engine]\nkind = "sglang"\nrenderer = "/no/such/model"\n'
    found = problems(load(tmp_path, text))
    one(found, "[run].model = '/no/such/model': no such folder", "[experiment.build_model]")
    if importlib.util.find_spec("sglang") is None:
        one(found, '[proxy.engine].kind = "sglang": SGLang is not installed', "pip install -e '.[sglang]'",
            "[proxy.engine].url")
    one(found, "[proxy.engine].renderer = '/no/such/model': no such folder")
    # a folder that is no model; a tokenizer folder without a chat template
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    (tok / "tokenizer.json").write_text("{}")
    found = problems(load(tmp_path, f'[run]\nmodel = "{tmp_path / "notes"}"\n[proxy.engine]\nrenderer = "{tok}"\n'))
    one(found, "not a Hugging Face model folder (no config.json in it)")
    why = one(found, f"[proxy.engine].renderer = '{tok}': no chat template there")
    (tok / "tokenizer.json").unlink()
    one(problems(load(tmp_path, f'[run]\nmodel = "{tmp_path / "notes"}"\n[proxy.engine]\nrenderer = "{tok}"\n')),
        f"[proxy.engine].renderer = '{tok}': no tokenizer there")
    (tok / "tokenizer.json").write_text("{}")
    assert "chat_template=" not in why  # a Python argument no config can set
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    again = load(tmp_path, f'[run]\nmodel = "{tmp_path / "notes"}"\n[proxy.engine]\nrenderer = "{tok}"\n')
    assert not any("renderer" in f for f in problems(again))


def test_build_model_never_writes_over_a_users_model(tmp_path):
    """A leftover [experiment.build_model] beside a real (sharded) model: refused before anything is written."""
    from pipeline.models.quickstart import ModelSpec, ensure_model

    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "qwen3"}')
    (mine / "model-00001-of-00002.safetensors").write_bytes(b"x")
    exp = load(tmp_path, f'[experiment.build_model]\nhidden_size = 16\n[run]\nmodel = "{mine}"\n')
    one(problems(exp), f"[run].model = '{mine}' holds a model bridle did not build",
        "remove [experiment.build_model]")
    with pytest.raises(ValueError, match="holds a model bridle did not build"):
        ensure_model(ModelSpec(path=str(mine), hidden_size=16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml", "my-model"]  # no .tmp beside it
    # a model bridle built there is reused; an empty folder is built into
    built = tmp_path / "built"
    create_small_model(built, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    assert not problems(load(tmp_path, f'[experiment.build_model]\nhidden_size = 16\n[run]\nmodel = "{built}"\n'))


def test_local_backend_names_a_missing_harness_executable(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDLE_HARNESS_BIN", str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    text = ('[graph]\npreset = "eval"\n[proxy.engine]\nkind = "scripted"\nscript = "configs/scripts/hello.json"\n'
            '[sandbox]\nbackend = "local"\n[eval]\nharnesses = ["codex", "whitebox"]\n')
    why = one(problems(load(tmp_path, text)), "the codex executable (codex) is not in")
    assert "npm install @openai/codex@" in why and "BRIDLE_HARNESS_BIN" in why


def test_docker_backend_names_missing_base_images_and_how_to_provide_them(tmp_path):
    require(docker_available(), "no Docker engine (start dockerd; harness_images/ci_setup.sh does it)")
    tasks = tmp_path / "tasks"
    shutil.copytree(HARBOR, tasks)
    dockerfile = tasks / "greeting" / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("ARG BASE=bridle-rootfs:bookworm",
                                                         "ARG BASE=bridle-test/absent:24.04"))
    text = ('[graph]\npreset = "eval"\n[proxy.engine]\nkind = "scripted"\nscript = "configs/scripts/hello.json"\n'
            f'[sandbox]\nbackend = "docker"\n[eval]\nharnesses = ["whitebox"]\ntasks = {{ tasks = "{tasks}" }}\n')
    why = one(problems(load(tmp_path, text)), "the image bridle-test/absent:24.04, which the Dockerfile of 1 task(s) "
                                              "builds on (greeting), is not on this machine")
    assert "docker load" in why and "base_images" in why
    mapped = ['sandbox.docker.base_images={"bridle-test/absent:24.04"="bridle-rootfs:bookworm"}']
    assert not any("absent" in f for f in problems(load(tmp_path, text, mapped)))


def test_docker_limits_over_this_machine_are_named_with_the_rest(tmp_path):
    """Checked before a run, not when the file is read (a file may be written for a bigger machine), and listed
    with the other problems rather than stopping before them."""
    text = ('[run]\nmodel = "/no/such/model"\n[sandbox]\nbackend = "docker"\n'
            '[sandbox.docker]\ncpus = 4096.0\nmemory = "4096g"\n')
    found = problems(load(tmp_path, text))
    one(found, "[run].model = '/no/such/model'")
    one(found, '[sandbox.docker] memory = \'4096g\' is more than this machine')
    found = problems(load(tmp_path, text.replace('memory = "4096g"', 'memory = "1g"')))
    one(found, "[sandbox.docker] cpus = 4096: this machine has")


def test_validate_reports_every_problem_at_once_and_exits_2(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('[run]\nmodel = "/no/such/model"\n[proxy.engine]\nrenderer = "/no/such/tok"\n')
    r = subprocess.run([sys.executable, "run.py", "--experiment", str(p), "--validate"], capture_output=True,
                       text=True, cwd=ROOT, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"error: {p}: this machine cannot run it yet:", r.stderr
    assert any("[run].model = '/no/such/model'" in x for x in lines[1:])
    assert any("[proxy.engine].renderer = '/no/such/tok'" in x for x in lines[1:])
