"""Event log: write/read, a cut last frame, damage detected by the frame checks, first-format frames, older schemas refused, offsets, the tap."""

import random
import re
import struct
import zlib

import anyio
import msgspec
import pytest

from pipeline.cli.launch import summary_text
from pipeline.core.eventlog import (
    MAGIC,
    MAGIC_V1,
    MAGIC_V2,
    AsyncEventLog,
    EventLogError,
    EventLogReader,
    EventLogWriter,
    LogHeader,
    summarize,
)
from pipeline.messages import (
    SCHEMA_VERSION,
    Event,
    Metric,
    ModelCall,
    Note,
    PolicyUpdated,
    RolloutFinished,
    ids,
    pack_f32,
    pack_i32,
)

HEAD = 16  # u32 length, u32 ~length, u32 sequence number, u32 crc32


def header(**kw):
    return LogHeader(schema_version=SCHEMA_VERSION, run_id="run-1", created=0.0, experiment="t",
                     config={"a": {"b": 1}}, **kw)


def frames(data: bytes) -> list[tuple[int, int]]:
    """(offset, payload length) of every frame after the magic, header frame first."""
    out, off = [], len(MAGIC)
    while off < len(data):
        (n,) = struct.unpack_from("<I", data, off)
        out.append((off, n))
        off += HEAD + n
    return out


def write(path, msgs):
    with EventLogWriter(path, header(), chunk_bytes=256) as w:
        for i, msg in enumerate(msgs):
            w.append(f"src{i % 3}.out", msg, t=float(i))


def test_write_read_round_trip(tmp_path):
    p = tmp_path / "events.msgpack"
    msgs = [Note(seq=i, value=i * 1.5) for i in range(1000)]
    call = ModelCall(rollout_id="r", call_id="c", seq=0, protocol="chat", input_ids=pack_i32(range(5000)),
                     output_ids=pack_i32([1, 2]), logprobs=pack_f32([-1, -2]))
    msgs.insert(500, call)
    write(p, msgs)
    r = EventLogReader(p)
    assert r.header.run_id == "run-1" and r.header.config == {"a": {"b": 1}}
    evs = list(r)
    assert [e.msg for e in evs] == msgs
    assert [e.t for e in evs] == [float(i) for i in range(len(msgs))]
    assert evs[3].src == "src0.out"
    assert ids(evs[500].msg.input_ids).tolist() == list(range(5000))
    assert r.report.truncated_at is None and r.report.frames == len(msgs)


def test_refuses_existing_file(tmp_path):
    p = tmp_path / "e.msgpack"
    write(p, [Note(seq=0)])
    with pytest.raises(FileExistsError):
        EventLogWriter(p, header())


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 10, 12, 13])
def test_truncated_last_frame_is_reported_and_nothing_earlier_is_lost(tmp_path, cut):
    p = tmp_path / "events.msgpack"
    msgs = [Note(seq=i, value="x" * 20) for i in range(50)]
    write(p, msgs)
    data = p.read_bytes()
    off, n = frames(data)[-1]
    assert off + HEAD + n == len(data) and cut <= HEAD + n  # the cut lands inside the last frame
    p.write_bytes(data[:-cut])
    r = EventLogReader(p)
    got = [e.msg for e in r]
    assert got == msgs[:-1]
    assert r.report.truncated_at == off
    assert "stops there" in r.report.problem
    s = summarize(p)
    assert s.events == 49 and s.truncated_at is not None


def test_reopen_truncates_exactly_the_cut_tail(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i) for i in range(10)])
    data = p.read_bytes()
    off, _n = frames(data)[-1]
    p.write_bytes(data[:-3])
    w = EventLogWriter.reopen(p)
    assert w.truncated_bytes == len(data) - 3 - off
    w.append("a.out", Note(seq=99))
    w.close()
    assert [e.msg.seq for e in EventLogReader(p)] == [*range(9), 99]


def test_damaged_payload_in_the_middle_is_an_error_not_silence(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i) for i in range(10)])
    data = bytearray(p.read_bytes())
    off, _n = frames(bytes(data))[5]
    data[off + HEAD + 2] ^= 0x01  # one bit of a payload: still decodes, but the CRC catches it
    p.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"frame at byte {off} is damaged .checksum"):
        list(EventLogReader(p))


def test_a_flipped_length_bit_is_damage_and_resume_does_not_truncate(tmp_path):
    """One flipped bit in a length field used to read as "the last frame is cut", and --resume then cut the log to
    half its size. The length's complement makes it damage: reading and reopening both refuse, nothing is cut."""
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i, value="y" * 30) for i in range(40)])
    data = bytearray(p.read_bytes())
    off, _n = frames(bytes(data))[20]
    data[off + 3] ^= 0x10  # a high bit of frame 20's length: it now points far past the end of the file
    p.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"frame at byte {off} is damaged .its length"):
        list(EventLogReader(p))
    with pytest.raises(EventLogError):
        EventLogWriter.reopen(p)
    assert p.read_bytes() == bytes(data)


def test_random_overwrites_never_replay_silently_and_name_the_damaged_frame(tmp_path):
    """64 random bytes written over a random place: either the reader raises naming the byte offset of a frame the
    damage touched, or (inside the last frame only) it stops before that frame; it never yields a message that was
    not written."""
    p = tmp_path / "events.msgpack"
    msgs = [Note(seq=i, value="z" * 40) for i in range(60)]
    write(p, msgs)
    clean = p.read_bytes()
    spans = [(off, off + HEAD + n) for off, n in frames(clean)]
    first_event = spans[1][0]
    rng = random.Random(7)
    for _ in range(200):
        data = bytearray(clean)
        at = rng.randrange(first_event, len(data) - 64)
        data[at:at + 64] = rng.randbytes(64)
        p.write_bytes(bytes(data))
        try:
            got = [e.msg for e in EventLogReader(p)]
        except EventLogError as e:
            named = [int(x) for x in re.findall(r"frame at byte (\d+)", str(e))]
            touched = {start for start, end in spans if start < at + 64 and end > at}
            assert named and named[0] in touched, (at, str(e))
            continue
        assert got == msgs[:len(got)] and len(got) < len(msgs)


def test_garbage_header_is_a_clear_error(tmp_path):
    p = tmp_path / "events.msgpack"
    body = b"\xc1\xc1\xc1"
    crc = zlib.crc32(body, zlib.crc32(struct.pack("<I", 0)))
    p.write_bytes(MAGIC + struct.pack("<IIII", len(body), len(body) ^ 0xFFFFFFFF, 0, crc) + body)
    with pytest.raises(EventLogError, match="header frame does not decode"):
        EventLogReader(p)


def test_first_format_frames_are_still_read(tmp_path):
    """Logs written before the frame checks: magic BRDLLOG1, u32 length + payload."""
    enc = msgspec.msgpack.encode
    h = enc(LogHeader(schema_version=SCHEMA_VERSION, run_id="old", created=0.0))
    evs = [enc(Event(t=float(i), src="a.out", msg=Note(seq=i))) for i in range(5)]
    p = tmp_path / "old.msgpack"
    p.write_bytes(MAGIC_V1 + b"".join(struct.pack("<I", len(x)) + x for x in [h, *evs]))
    r = EventLogReader(p)
    assert r.version == 1 and [e.msg.seq for e in r] == list(range(5))
    with pytest.raises(EventLogError, match="cannot be appended to"):
        EventLogWriter.reopen(p)


def test_an_older_message_schema_is_refused_with_its_version(tmp_path):
    enc = msgspec.msgpack.encode
    p = tmp_path / "old.msgpack"
    p.write_bytes(MAGIC_V1 + b"".join(struct.pack("<I", len(x)) + x
                                      for x in [enc(LogHeader(schema_version=1, run_id="old", created=0.0))]))
    with pytest.raises(EventLogError, match=f"message schema 1, .* reads schema {SCHEMA_VERSION}"):
        EventLogReader(p)


def test_not_a_log(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"hello world")
    with pytest.raises(EventLogError, match="not a bridle event log"):
        EventLogReader(p)
    with pytest.raises(EventLogError, match="no such event log"):
        EventLogReader(tmp_path / "missing")


def test_offsets_resume_reading(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i) for i in range(20)])
    r = EventLogReader(p)
    offs = list(r.iter_with_offsets())
    resumed = [e.msg.seq for _o, e in EventLogReader(p).iter_with_offsets(start=offs[9][0])]
    assert resumed == list(range(10, 20))


def test_summary_counts(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [
        RolloutFinished(rollout_id="r1", group_id="g", status="ok"),
        RolloutFinished(rollout_id="r2", group_id="g", status="timeout"),
        PolicyUpdated(version=1, step=1), PolicyUpdated(version=2, step=2),
        Metric(source="x"),
    ])
    s = summarize(p)
    assert s.by_type == {"Metric": 1, "PolicyUpdated": 2, "RolloutFinished": 2}
    assert (s.rollouts, s.groups, s.steps, s.cold_start, s.last_policy_version) == (2, 1, 2, False, 2)
    assert s.span_s == 4.0
    p2 = tmp_path / "sft.msgpack"
    write(p2, [PolicyUpdated(version=1, step=0), PolicyUpdated(version=2, step=1)])  # SFT, then one RL step
    s = summarize(p2)
    assert (s.steps, s.cold_start) == (1, True)
    assert "steps 1 after the cold-start SFT   policy version 2" in summary_text(s)


@pytest.mark.anyio
async def test_async_tap_flushes_in_background_and_on_close(tmp_path):
    p = tmp_path / "events.msgpack"
    log = AsyncEventLog(EventLogWriter(p, header()), flush_interval=0.01)
    async with anyio.create_task_group() as tg:
        tg.start_soon(log.run_flusher)
        for i in range(100):
            await log.record("a.out", Note(seq=i))
        await anyio.sleep(0.1)
        # written by the flusher already, before any close
        assert len(list(EventLogReader(p))) == 100
        for i in range(100, 150):
            log.record_nowait("a.out", Note(seq=i))
        tg.cancel_scope.cancel()
    log.close()
    assert [e.msg.seq for e in EventLogReader(p)] == list(range(150))


@pytest.mark.anyio
async def test_async_tap_backpressure_when_disk_lags(tmp_path):
    p = tmp_path / "events.msgpack"
    log = AsyncEventLog(EventLogWriter(p, header()), flush_interval=10.0, max_pending_bytes=4096)
    for i in range(2000):
        await log.record("a.out", Note(seq=i, value="y" * 50))
        assert log.writer.pending_bytes <= 4096 + 200
    log.close()
    assert len(list(EventLogReader(p))) == 2000


def test_reopen_truncates_a_cut_frame_and_appends(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i) for i in range(10)])
    p.write_bytes(p.read_bytes()[:-3])  # kill -9 mid-write
    w = EventLogWriter.reopen(p)
    assert w.truncated_bytes > 0
    for i in range(10, 15):
        w.append("b.out", Note(seq=i))
    w.close()
    r = EventLogReader(p)
    assert [e.msg.seq for e in r] == [*range(9), *range(10, 15)]
    assert r.report.truncated_at is None and r.header.run_id == "run-1"


# ------------------------------------------------------------------------------ gaps, crafted lengths, zeros
def _events(p):
    return [ev.msg for ev in EventLogReader(p)]


def test_a_frame_removed_or_repeated_in_the_middle_is_named(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i, value=0.0) for i in range(10)])
    data = p.read_bytes()
    fr = frames(data)
    off, n = fr[4]  # an event frame in the middle
    cut = data[:off] + data[off + HEAD + n:]
    p.write_bytes(cut)
    with pytest.raises(EventLogError, match=rf"frame at byte {off} has sequence number 5, expected 4: frames are "
                                            "missing"):
        _events(p)
    with pytest.raises(EventLogError):
        EventLogWriter.reopen(p)
    p.write_bytes(data[:off + HEAD + n] + data[off:])  # the same frame twice
    with pytest.raises(EventLogError, match="a frame is repeated"):
        _events(p)


def test_a_length_pointing_past_the_end_with_frames_after_it_is_damage_not_a_cut_tail(tmp_path):
    p = tmp_path / "events.msgpack"
    write(p, [Note(seq=i, value=0.0) for i in range(200)])
    data = bytearray(p.read_bytes())
    size = len(data)
    off, _n = frames(bytes(data))[50]
    big = size  # past the end, with a consistent complement: only what follows tells it from a cut
    struct.pack_into("<II", data, off, big, big ^ 0xFFFFFFFF)
    p.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=rf"frame at byte {off} claims more than the file holds .* a whole frame "
                                            "follows"):
        _events(p)
    with pytest.raises(EventLogError):
        EventLogWriter.reopen(p)  # resume refuses: nothing is truncated
    assert p.stat().st_size == size


def test_a_zero_filled_tail_is_a_cut_tail_that_resume_truncates(tmp_path):
    p = tmp_path / "events.msgpack"
    msgs = [Note(seq=i, value=0.0) for i in range(30)]
    write(p, msgs)
    whole = p.stat().st_size
    with p.open("ab") as f:
        f.write(bytes(8192))  # what a power loss leaves: the file's length grew, its blocks did not
    r = EventLogReader(p)
    assert [ev.msg for ev in r] == msgs and r.report.truncated_at == whole
    w = EventLogWriter.reopen(p)
    w.append("src.out", Note(seq=99, value=1.0))
    w.close()
    assert _events(p) == [*msgs, Note(seq=99, value=1.0)]


def test_a_schema_2_log_is_read_and_continued_in_its_own_frames(tmp_path):
    p = tmp_path / "events.msgpack"
    enc = msgspec.msgpack.Encoder()

    def frame(obj):
        body = enc.encode(obj)
        return struct.pack("<III", len(body), len(body) ^ 0xFFFFFFFF, zlib.crc32(body)) + body

    msgs = [Note(seq=i, value=0.0) for i in range(5)]
    p.write_bytes(MAGIC_V2 + frame(header()) + b"".join(frame(Event(t=0.0, src="a.b", msg=m)) for m in msgs))
    assert _events(p) == msgs
    w = EventLogWriter.reopen(p)
    w.append("a.b", Note(seq=5, value=0.0))
    w.close()
    assert p.read_bytes().startswith(MAGIC_V2) and _events(p) == [*msgs, Note(seq=5, value=0.0)]
