"""launch_sglang against a stand-in `sglang.launch_server` module (SGLang itself cannot run on CPU machines)."""

from __future__ import annotations

import json
import textwrap

import anyio
import pytest

from pipeline.serving.launch import launch_sglang

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, sys
    from aiohttp import web
    if os.environ.get("FAKE_SGLANG_FAIL"):
        print("CUDA error: no kernel image is available", flush=True)
        sys.exit(3)
    p = argparse.ArgumentParser()
    for a in ("--model-path", "--host", "--port", "--weight-version", "--mem-fraction-static", "--tp"):
        p.add_argument(a)
    p.add_argument("--skip-server-warmup", action="store_true")
    args = p.parse_args()
    open(os.environ["FAKE_SGLANG_ARGS"], "w").write(json.dumps(vars(args)))
    async def health(_):
        return web.Response()
    async def info(_):
        return web.json_response({"model_path": args.model_path, "weight_version": args.weight_version})
    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/model_info", info)])
    web.run_app(app, host=args.host, port=int(args.port), print=None)
    """
)


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_SGLANG_ARGS", str(tmp_path / "args.json"))
    return tmp_path


def test_launch_waits_for_readiness_and_stops_the_server(fake_sglang):
    async def main():
        async with launch_sglang(
            "/ckpt/base",
            weight_version="0",
            mem_fraction_static=0.7,
            extra_args=["--tp", "2"],
            timeout_s=60,
            log_path=fake_sglang / "sglang.log",
        ) as client:
            info = await client.model_info()
            url = client.base_url
        return info, url

    info, url = anyio.run(main)
    assert info == {"model_path": "/ckpt/base", "weight_version": "0"}
    args = json.loads((fake_sglang / "args.json").read_text())
    assert args["model_path"] == "/ckpt/base" and args["skip_server_warmup"] and args["tp"] == "2"
    assert args["mem_fraction_static"] == "0.7" and url.endswith(f":{args['port']}")


def test_launch_reports_an_early_exit_with_the_log(fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "1")

    async def main():
        async with launch_sglang("/ckpt/base", timeout_s=60, log_path=fake_sglang / "sglang.log"):
            pass

    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*no kernel image"):
        anyio.run(main)
