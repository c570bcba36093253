"""Drive a real harness binary through the proxy with a scripted engine; compare successive calls' ids."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import numpy as np

from pipeline.messages import ids
from pipeline.rollout.harnesses import LaunchContext, launch_for
from pipeline.serving.scripted import Script, ScriptResponse
from tests.helpers.proxyutil import renderer, running_proxy


def first_divergence(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


async def run_harness(harness: str, tmp_path: Path, first_call: ScriptResponse, binary: str,
                      ) -> tuple[subprocess.CompletedProcess, list, Path]:
    """One scripted tool call then a final answer, through the real proxy; returns the process and the records."""
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    script = Script(default=[first_call, ScriptResponse(text="The file is written.")])
    async with running_proxy(script) as (p, records, _token):
        token = p.open_rollout(f"{harness}-1")
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction="Create hello.txt containing: hello from bridle", binary=binary)
        launch = launch_for(harness, ctx)
        for path, content in launch.files.items():
            await anyio.Path(path).parent.mkdir(parents=True, exist_ok=True)
            await anyio.Path(path).write_text(content)
        env = {"PATH": os.environ["PATH"], **launch.env}
        with anyio.fail_after(240):
            proc = await anyio.run_process(launch.argv, env=env, cwd=ws, stdin=subprocess.DEVNULL, check=False)
    return proc, records, ws


def check_prefix(calls) -> tuple[int, int, str]:
    """(where call 2 diverges from call 1's input + output, len of that, the rewritten text)."""
    a = np.concatenate([ids(calls[0].input_ids), ids(calls[0].output_ids)])
    b = ids(calls[1].input_ids)
    k = first_divergence(a, b)
    tok = renderer().tokenizer
    return k, len(a), tok.decode(a[k:k + 40].tolist()) + " || " + tok.decode(b[k:k + 40].tolist())
