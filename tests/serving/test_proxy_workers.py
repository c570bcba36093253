"""Proxy workers (pipeline/serving/proxy_workers.py): the control frames, then real worker processes routing,
serving and refusing rollouts, and a dead worker failing the run with its log."""

import asyncio
import os
import signal
import tempfile

import aiohttp
import anyio
import msgspec
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import ModelCall, RolloutRequest, SamplingParams, pack_f32, pack_i32
from pipeline.serving.factory import EngineSettings
from pipeline.serving.proxy import ProxySettings
from pipeline.serving.proxy_workers import (
    FROM_WORKER,
    MAX_FRAME,
    TO_WORKER,
    Forget,
    FrameError,
    Hello,
    ProxyWorkers,
    Register,
    Registered,
    Setup,
    Version,
    WorkerDied,
    encode_frame,
    read_frame,
    worker_endpoint,
)


def request(rid: str, script: list | None = None) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id="t", harness="manual",
                          token=f"tok-{rid}", policy_version=0, sampling=SamplingParams(max_new_tokens=8),
                          script=script or [])


def model_call(n: int) -> ModelCall:
    return ModelCall(rollout_id="r", call_id="c", seq=0, protocol="chat", label="main", input_ids=pack_i32(range(n)),
                     output_ids=pack_i32([1, 2]), logprobs=pack_f32([-0.5, -0.25]), finish_reason="stop")


FROM = [Hello(worker=1, pid=7), Registered(rollout_id="r"), model_call(3), model_call(2000)]
TO = [Register(request=request("a")), Forget(rollout_id="a"), Version(version=4)]


async def frames_through(chunks: list[bytes], decoder: msgspec.msgpack.Decoder, n: int) -> list:
    send, recv = anyio.create_memory_object_stream[bytes](len(chunks) + 1)
    for c in chunks:
        send.send_nowait(c)
    send.close()
    reader = BufferedByteReceiveStream(recv)
    return [await read_frame(reader.receive_exactly, decoder) for _ in range(n)]


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=12))
def test_frames_decode_the_same_however_the_stream_is_cut(cuts):
    data = b"".join(encode_frame(m) for m in FROM)
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]
    got = anyio.run(frames_through, chunks, FROM_WORKER, len(FROM))
    assert got == FROM


def test_each_side_decodes_its_own_frames_only():
    got = anyio.run(frames_through, [bytes(encode_frame(m)) for m in TO], TO_WORKER, len(TO))
    assert got == TO
    with pytest.raises(FrameError, match="undecodable"):
        anyio.run(frames_through, [bytes(encode_frame(Version(version=1)))], FROM_WORKER, 1)


def test_a_length_past_the_limit_is_refused_and_a_cut_frame_is_incomplete():
    with pytest.raises(FrameError, match="out of step"):
        anyio.run(frames_through, [(MAX_FRAME + 1).to_bytes(4, "little") + b"x"], FROM_WORKER, 1)
    whole = bytes(encode_frame(Hello(worker=0, pid=1)))
    with pytest.raises(anyio.IncompleteRead):
        anyio.run(frames_through, [whole[:-1]], FROM_WORKER, 1)


def test_each_worker_gets_its_own_socket_and_port():
    s = ProxySettings(port=0, unix_socket="/tmp/x/proxy.sock")
    assert [(w.port, w.unix_socket) for w in (worker_endpoint(s, i) for i in range(2))] == [
        (0, "/tmp/x/proxy-0.sock"), (0, "/tmp/x/proxy-1.sock")]
    assert worker_endpoint(ProxySettings(port=9000), 2).port == 9002
    assert worker_endpoint(ProxySettings(unix_socket=""), 1).unix_socket == ""
    assert worker_endpoint(ProxySettings(), 1).unix_socket == "auto"


# ------------------------------------------------------------------------------------ real worker processes
def pool(tmp_path, records: list, n: int = 2) -> ProxyWorkers:
    async def emit(msg):
        records.append(msg)

    control_dir = tempfile.mkdtemp(prefix="bridle-pw-test-")  # a socket path must stay under 108 bytes
    settings_ = ProxySettings(unix_socket=os.path.join(control_dir, "proxy.sock"))
    # no engine call is made: the rollouts here are scripted, played by each worker's own scripted engine
    setup = Setup(proxy=settings_, renderer=EngineSettings(), engine_url="http://127.0.0.1:9",
                  control_urls=["http://127.0.0.1:9"], generate_timeout_s=10, policy_version=0)
    return ProxyWorkers(n, settings_, setup, emit, control_dir=control_dir, log_dir=tmp_path)


async def chat(base_url: str, token: str, sock: str = "") -> int:
    conn = aiohttp.UnixConnector(path=sock) if sock else None
    async with aiohttp.ClientSession(connector=conn) as s, s.post(
            f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
            json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]}) as r:
        await r.read()
        return r.status


@pytest.mark.slow
@pytest.mark.anyio
async def test_rollouts_are_spread_over_the_workers_and_only_their_own_worker_serves_them(tmp_path):
    records: list = []
    p = pool(tmp_path, records)
    script = [{"text": "one"}, {"text": "two"}]
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(p.run)
            routed = [await p.register(request(r, script)) for r in ("a", "b", "c")]
        assert [r.proxy.worker for r in routed] == [0, 1, 0]  # the least busy, lowest index first
        a, b = routed[0], routed[1]
        with anyio.fail_after(30):
            assert await chat(a.proxy.base_url, a.token) == 200
            assert await chat(b.proxy.base_url, b.token, sock=b.proxy.unix_socket) == 200
            assert await chat(b.proxy.base_url, a.token) == 401  # worker 1 never heard of rollout a
            await p.forget("a")
            assert (await p.register(request("d", script))).proxy.worker == 0  # a's place was freed
            assert await chat(a.proxy.base_url, a.token) == 401  # forgotten
        tg.cancel_scope.cancel()
    calls = [m for m in records if isinstance(m, ModelCall)]
    assert [(m.rollout_id, m.seq) for m in calls] == [("a", 0), ("b", 0)]
    assert [w.calls for w in p.workers] == [1, 1]
    assert "proxy worker stopped" in (tmp_path / "proxy-worker-1.log").read_text()


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_worker_that_dies_fails_the_run_with_its_log(tmp_path):
    p = pool(tmp_path, [])
    with pytest.raises(BaseExceptionGroup) as caught, anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            with (tmp_path / "proxy-worker-1.log").open("a") as f:
                f.write("last words\n")
            os.kill(p.workers[1].pid, signal.SIGKILL)
            await anyio.sleep_forever()
    group = caught.value.subgroup(lambda e: isinstance(e, WorkerDied))
    died = []
    while group is not None and not died:  # task groups nest: the pool's inside this one
        died = [e for e in group.exceptions if isinstance(e, WorkerDied)]
        group = next((e for e in group.exceptions if isinstance(e, BaseExceptionGroup)), None)
    assert died and "proxy worker 1" in str(died[0]) and "last words" in str(died[0]), caught.value.exceptions


class _Channel:
    """A worker's control channel as the actor writes it; ``dead``: the worker died, draining finds it gone."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        if self.dead:
            raise ConnectionResetError("Connection lost")


async def _ignore(msg) -> None:
    pass


def _bare_pool(tmp_path) -> ProxyWorkers:
    """Two workers' bookkeeping, no processes."""
    setup = Setup(proxy=ProxySettings(), renderer=EngineSettings(), engine_url="", control_urls=[],
                  generate_timeout_s=1, policy_version=0)
    return ProxyWorkers(2, ProxySettings(), setup, _ignore, control_dir=str(tmp_path), log_dir=tmp_path)


@pytest.mark.anyio
async def test_a_send_on_a_dead_channel_leaves_the_report_to_the_watch(tmp_path, monkeypatch):
    """A send that found a dead worker's channel raised its own WorkerDied beside the reader's ("exited with code
    -9"): the run's crash then said only "unhandled errors in a TaskGroup (2 sub-exceptions)" (the fault campaign,
    benchmarks/faults.py, hit it on 2 of 2 proxy-worker kills). It now leaves the report to the worker's reader
    (cancelled by it), and reports the worker itself only if nothing has within the grace."""
    p = _bare_pool(tmp_path)
    w = p.workers[1]
    w.writer = _Channel(dead=True)  # type: ignore[assignment]
    p.owner["r"] = w
    with anyio.move_on_after(1) as waiting:
        await p.forget("r")
    assert waiting.cancelled_caught  # still leaving it to the reader: one error for the run
    monkeypatch.setattr("pipeline.serving.proxy_workers.READER_GRACE_S", 0.1)
    p.owner["r"] = w
    with pytest.raises(WorkerDied, match="proxy worker 1: its control channel failed"), anyio.fail_after(5):
        await p.forget("r")


@pytest.mark.anyio
async def test_a_worker_that_dies_in_its_handshake_is_named(tmp_path, monkeypatch):
    """A worker killed between its Hello and its Ready failed the run with "IncompleteReadError: 0 bytes read on a
    total of 4 expected bytes", naming no worker (the fault campaign). The start watch reports an exited worker
    with its exit code; failing that, the handshake names the worker."""
    monkeypatch.setattr("pipeline.serving.proxy_workers.READER_GRACE_S", 0.1)
    p = _bare_pool(tmp_path)
    said_hello = asyncio.StreamReader()
    said_hello.feed_data(bytes(encode_frame(Hello(worker=1, pid=7))))
    said_hello.feed_eof()
    with pytest.raises(WorkerDied, match="proxy worker 1: closed its control channel in its handshake"):
        await p._handshake(said_hello, _Channel(dead=False))  # type: ignore[arg-type]
    silent = asyncio.StreamReader()
    silent.feed_eof()
    with pytest.raises(WorkerDied, match="a proxy worker closed its control channel before saying which it is"):
        await p._handshake(silent, _Channel(dead=False))  # type: ignore[arg-type]


@pytest.mark.parametrize(("extra", "match"), [
    (['proxy.engine={kind="scripted", script="x.json"}'], "scripted engine lives in the proxy's process"),
    # the Ray relays serve a socket per worker, each dialling the worker's own port: one fixed address cannot
    (['sandbox.backend="ray"', 'sandbox.ray.proxy_address="10.0.0.1:8000"'],
     r"proxy_address = '10.0.0.1:8000': that is one host:port, and each worker listens on its own"),
])
def test_the_config_refuses_workers_where_a_rollout_could_not_reach_its_worker(extra, match):
    from actors import REGISTRY
    from pipeline.core import config as cfg
    from pipeline.core.runtime import make_resolver

    cfg.load_experiment("quickstart", make_resolver(REGISTRY), ["proxy.workers=1", *extra])  # one proxy: fine
    with pytest.raises(cfg.ConfigError, match=match) as e:
        cfg.load_experiment("quickstart", make_resolver(REGISTRY), ["proxy.workers=2", *extra])
    if "proxy_address" in match:  # both --set values it names are blamed
        assert str(e.value).endswith("(from --set proxy.workers=2, --set sandbox.ray.proxy_address=\"10.0.0.1:8000\")")


def test_workers_with_the_ray_backend_pass_the_config_check():
    from actors import REGISTRY
    from pipeline.core import config as cfg
    from pipeline.core.runtime import make_resolver

    exp = cfg.load_experiment("quickstart", make_resolver(REGISTRY),
                              ["proxy.workers=2", 'sandbox.backend="ray"', 'proxy.host="0.0.0.0"'])
    assert exp.section("proxy").workers == 2
