"""Learner ranks (pipeline/training/ranks.py): N processes started by Accelerate's launcher, DDP over gloo on the
CPU. One step with 2 ranks gives the weights of 1 rank, for uneven shares, an idle rank, minibatches, KL, the
per-rollout mean and SFT; a failing rank fails the call with its traceback, a dead one with the log's end."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.messages import ids
from pipeline.training import batches
from pipeline.training.learner import Learner
from pipeline.training.ranks import RankError, start_ranks
from pipeline.training.stage import stage_settings
from tests.helpers.learner_trees import group, random_paths, tiny_qwen3

# Weights after one AdamW step, 2 ranks against 1. The first Adam step is lr * g / (|g| + eps): with eps small, a
# gradient that is rounding noise (~1e-9, its sign a coin flip between summation orders) would move a weight by
# a full lr either way. eps = 1e-4 makes the step continuous in g, so the comparison measures the gradients'
# agreement: float32 sums in another order differ by ~1e-7 relative, which moves a weight by << TOL.
TOL = 2e-6
BASE = {"lr": 1e-3, "adam_eps": 1e-4, "attention": "dense", "micro_batch_tokens": 64}

CASES = {
    # 5 groups of different sizes: uneven shares, several micro-batches on one rank, fewer on the other
    "grpo_uneven": ({}, 5),
    "kl_seq_mean_minibatches": ({"kl_coef": 0.1, "loss_agg": "seq_mean_token_mean", "minibatches": 2}, 4),
    "ppo_two_epochs": ({"advantage": "ppo", "value_trunk_grad": True, "epochs": 2}, 3),
    "one_group_idle_rank": ({}, 1),
    "sft": ({}, 3),
}


def _groups(n: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        k = int(rng.integers(2, 5))
        statuses = ["ok"] * k
        if g == 1:
            statuses[0] = "sandbox_error"
        out.append(group(random_paths(rng, k), list(rng.random(k).round(2)), statuses, gid=f"g{g}"))
    return out


def test_shares_are_whole_trees_balanced_by_tokens():
    assert batches.shares([10, 1, 7, 3, 3], 2) == [[0, 4], [1, 2, 3]]  # 10+3 | 7+3+1
    assert batches.shares([5], 3) == [[0], [], []]
    assert batches.shares([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = list(rng.integers(1, 100, rng.integers(1, 12)))
        got = batches.shares(sizes, 3)
        assert sorted(i for s in got for i in s) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in s) for s in got]
        assert max(loads) - min(loads) <= max(sizes)  # greedy largest-first bound


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_qwen3(3).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    # The ranks run 1 thread each; the 1-rank reference (in this process) too, on a shared, busy CPU
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_two_ranks_give_the_weights_of_one(model_dir, tmp_path):
    want, got_metrics = {}, {}
    for name, (kw, n) in CASES.items():
        cfg = stage_settings(**{**BASE, **kw})
        one = Learner(model_dir, cfg)
        groups = _groups(n, seed=len(name))
        m = one.sft_step(groups) if name == "sft" else one.train_step(groups)
        one.save_weights(tmp_path / f"one-{name}")
        want[name] = m

    async def two() -> None:
        async with start_ranks(2, log_path=tmp_path / "ranks.log", threads=1, timeout_s=300) as ranks:
            for name, (kw, n) in CASES.items():
                await ranks.init(str(model_dir), stage_settings(**{**BASE, **kw}))
                groups = _groups(n, seed=len(name))
                call = ranks.sft_step if name == "sft" else ranks.train_step
                got_metrics[name] = await call(groups)
                await ranks.save_weights(tmp_path / f"two-{name}", ranks.version)

    anyio.run(two)
    for name in CASES:
        a = load_file(tmp_path / f"one-{name}" / "model.safetensors")
        b = load_file(tmp_path / f"two-{name}" / "model.safetensors")
        base = tiny_qwen3(3).state_dict()
        moved = max((a[k] - base[k]).abs().max().item() for k in a)
        assert moved > 1e-4, f"{name}: the step did not move the weights"  # the comparison below means something
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=TOL, msg=f"{name}: {k}")
        for k in ("loss", "trainable_tokens", "tokens", "entropy", "grad_norm"):
            assert got_metrics[name][k] == pytest.approx(want[name][k], rel=1e-5, abs=1e-6), (name, k)
        if name != "sft":
            assert got_metrics[name]["reward_mean"] == pytest.approx(want[name]["reward_mean"])


def test_a_checkpoint_of_two_ranks_resumes_in_one(model_dir, tmp_path):
    """Under DDP every rank holds the whole model and optimizer, so a checkpoint written by 2 ranks resumes in 1
    (rank 1's RNG state is simply not loaded): the next step gives the weights the 2 ranks reached."""
    cfg = stage_settings(**BASE, schedule="cosine", total_steps=4)
    steps = [_groups(3, seed=7), _groups(3, seed=8)]

    async def two() -> None:
        async with start_ranks(2, log_path=tmp_path / "ranks.log", threads=1, timeout_s=300) as ranks:
            await ranks.init(str(model_dir), cfg)
            await ranks.train_step(steps[0])
            await ranks.save_checkpoint(tmp_path / "ckpt", {"steps_done": 1})
            await ranks.train_step(steps[1])
            await ranks.save_weights(tmp_path / "two", ranks.version)

    anyio.run(two)
    one = Learner(model_dir, cfg)
    assert one.load_checkpoint(tmp_path / "ckpt") == {"steps_done": 1}
    assert (one.step, one.version) == (1, 1)
    one.train_step(steps[1])
    want = load_file(tmp_path / "two" / "model.safetensors")
    got = one.net.policy.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=TOL, msg=k)


def test_a_failing_rank_fails_the_call_with_its_traceback(model_dir, tmp_path):
    bad = _groups(2, seed=1)
    # group 1's tree points at a rollout slot it does not have: whichever rank holds it raises
    packed = msgspec.structs.replace(bad[1].packed, rollout=bad[1].packed.rollout[:-4] + np.int32(99).tobytes())
    bad[1] = msgspec.structs.replace(bad[1], packed=packed)
    assert ids(bad[1].packed.rollout)[-1] == 99

    async def go() -> None:
        async with start_ranks(2, log_path=tmp_path / "ranks.log", threads=1, timeout_s=120) as ranks:
            await ranks.init(str(model_dir), stage_settings(**BASE))
            with pytest.raises(RankError, match=r"(?s)failed in train_step.*refers to slot 99"):
                await ranks.train_step(bad)

    anyio.run(go)


def test_a_killed_rank_fails_the_run_at_once(model_dir, tmp_path):
    log = tmp_path / "ranks.log"

    async def go() -> None:
        async with start_ranks(2, log_path=log, threads=1, timeout_s=600) as ranks:
            await ranks.init(str(model_dir), stage_settings(**BASE))
            os.kill(ranks.pids[1], signal.SIGKILL)
            # rank 0 sees its peer gone (gloo: connection reset) or the launcher stops it first: either way the
            # call fails with the reason within seconds, not at the 600 s timeout
            with anyio.fail_after(60), pytest.raises(RankError, match="Connection reset|launcher exit code"):
                await ranks.train_step(_groups(2, seed=0))

    anyio.run(go)


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_launch_command_is_one_accelerate_parses(fsdp):
    """Every flag start_ranks passes is one of Accelerate's launcher (FSDP's too, which no CPU test can run:
    Accelerate turns FSDP on only for accelerator ranks)."""
    from accelerate.commands.launch import launch_command_parser

    from pipeline.training.ranks import launch_command

    cmd = launch_command(2, "/tmp/x.sock", cuda=True, gpus="0,1", fsdp=fsdp, threads=3)
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(cmd[3:])
    assert (args.num_processes, args.gpu_ids, args.num_cpu_threads_per_process) == (2, "0,1", 3)
    assert args.module and args.training_script == "pipeline.training.rank_worker"
    assert args.training_script_args == ["--socket", "/tmp/x.sock", "--threads", "3"]
    if fsdp:
        assert args.use_fsdp and args.fsdp_state_dict_type == "FULL_STATE_DICT"
        assert args.fsdp_auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    else:
        assert args.multi_gpu and not args.use_fsdp


@pytest.mark.anyio
async def test_the_learner_actor_trains_on_two_ranks_and_a_dead_rank_fails_it(model_dir, tmp_path):
    """``[learner] processes = 2``: the actor's step goes through the ranks (weights and checkpoint written by rank
    0, each rank's RNG state saved); then a rank killed between steps fails the actor with a RankError, and no
    rank is left running."""
    from actors.learner import LearnerActor, LearnerSettings
    from pipeline.core.config import RunSection
    from pipeline.core.runtime import ActorContext
    from tests.helpers.live_actor import live

    run_dir = tmp_path / "run"
    c = LearnerSettings(processes=2, threads=1, train=stage_settings(**BASE))
    actor = LearnerActor("learner", c, ActorContext(
        run_dir=run_dir, run=RunSection(model=str(model_dir), steps=3, groups_per_step=2)))
    with pytest.raises(BaseExceptionGroup) as info:
        async with live(actor) as lv:
            for g in _groups(2, seed=0):
                await lv.inbox.send(g)
            (up,) = await lv.wait_for("updates", 1, timeout_s=120)
            assert (up.step, up.version) == (1, 1)
            assert (Path(up.weights_path) / "model.safetensors").is_file()
            ckpt = run_dir / "checkpoints" / "step00001"
            assert {"learner_state.json", "random_states_0.pkl", "random_states_1.pkl"} <= {
                p.name for p in ckpt.iterdir()}
            pids = list(actor.learner.pids)
            os.kill(pids[1], signal.SIGKILL)
            for g in _groups(2, seed=1):
                await lv.inbox.send(msgspec.structs.replace(g, group_id=f"{g.group_id}b", issued_version=1))
            with anyio.fail_after(90):
                await anyio.sleep_forever()  # the actor's failure cancels this
    errors = info.value.exceptions
    assert len(errors) == 1 and isinstance(errors[0], RankError), errors
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:  # noqa: ASYNC110 — no signal to wait on
        await anyio.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a learner rank outlived the actor"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent (the launcher's init) reaps it
