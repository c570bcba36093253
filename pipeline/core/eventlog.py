"""Append-only event log: every message of a run, replayable.

File layout::

    b"BRDLLOG3"                      8-byte magic
    frame(msgpack(LogHeader))        sequence number 0
    frame(msgpack(Event))            one frame per message, in the order they were sent: 1, 2, ...
    ...

    frame = u32 length, u32 (length XOR 0xFFFFFFFF), u32 sequence number, u32 crc32(sequence number + payload),
            payload                                                                             (little-endian)

Frames are encoded straight into one growing buffer (``msgspec.Encoder.encode_into``) and written in large chunks,
so appending costs one encode, one CRC and no syscall. A crash (even ``kill -9``) can only cut the *last* frame:
fewer bytes than its header, or than its length says; a power loss can also leave the file's end filled with zeros.
The reader reports either and stops there, nothing before it is lost, and ``--resume`` truncates exactly that tail.
Anything else is damage, not a crash: a length that disagrees with its complement (one flipped bit), a payload whose
CRC is wrong, a frame that does not decode, a sequence number that skips or repeats (a frame removed or copied), and
a length that points past the end of the file while whole frames follow it (a cut tail is the end of the file;
damage in the middle is not). The reader then raises :class:`EventLogError` naming the byte offset, and nothing is
truncated or replayed past it. Logs of schema 2 (``BRDLLOG2``: the same frames without the sequence number) are read
and continued as they are. With
:class:`AsyncEventLog` the buffer is written by a worker thread at least every ``flush_interval`` seconds, so a
``kill -9`` loses at most that much.

Frames of the first format (magic ``BRDLLOG1``: u32 length + payload, no checks) are still read. Messages of an
older schema than :data:`pipeline.messages.SCHEMA_VERSION` are refused with the version named: replay such a log
with the bridle that wrote it.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import anyio
import msgspec
import numpy as np

from pipeline.core.logs import get_logger
from pipeline.core.outcomes import Outcomes
from pipeline.messages import SCHEMA_VERSION, Event, Message, RolloutFinished

MAGIC = b"BRDLLOG3"
MAGIC_V2 = b"BRDLLOG2"
MAGIC_V1 = b"BRDLLOG1"
_HEAD = struct.Struct("<IIII")  # length, ~length, sequence number, crc32(sequence number + payload)
_HEAD_V2 = struct.Struct("<III")  # length, ~length, crc32(payload)
_SEQ = struct.Struct("<I")
_LEN = struct.Struct("<I")  # schema-1 frames: the length alone
_MAX_FRAME = 1 << 31
_NOT = 0xFFFFFFFF


class LogHeader(msgspec.Struct, kw_only=True):
    schema_version: int
    run_id: str
    created: float
    experiment: str = ""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    replay_of: str = ""  # set when this log was produced by replaying another


class EventLogError(Exception):
    pass


class EventLogWriter:
    """Synchronous writer. Not thread-safe: one owner appends; :meth:`take` hands the buffer to a flusher."""

    def __init__(self, path: Path | str, header: LogHeader, *, chunk_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(MAGIC)
        self._chunk = chunk_bytes
        self.frames = 0
        self.bytes_written = 0
        self.version = 3
        self._seq = 0
        self._frame(header)
        self.flush()

    @classmethod
    def reopen(cls, path: Path | str, *, chunk_bytes: int = 1 << 20) -> EventLogWriter:
        """Continue an existing log (``--resume``): a frame cut by a crash is truncated away first, so the file
        stays a clean sequence of frames; everything before it is kept."""
        reader = EventLogReader(path)
        if reader.version == 1:
            raise EventLogError(f"{reader.path}: a schema-1 log (bridle before the per-frame checksums) cannot be "
                                "appended to; replay it, or start a new run")
        end = reader.start_offset  # then the end of the last whole frame: reading stops before a cut one
        for off, _ev in reader.iter_with_offsets():
            end = off
        next_seq = reader.next_seq
        self = cls.__new__(cls)
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY)
        os.ftruncate(self._fd, end)
        os.lseek(self._fd, end, os.SEEK_SET)
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray()
        self._chunk = chunk_bytes
        self.frames = 0
        self.bytes_written = end
        self.truncated_bytes = len(reader._data) - end
        self.version = reader.version  # a schema-2 log is continued in its own frames
        self._seq = next_seq
        return self

    def _frame(self, obj: Any) -> None:
        buf = self._buf
        start = len(buf)
        if self.version == 2:
            head = _HEAD_V2.size
            buf.extend(bytes(head))
            self._enc.encode_into(obj, buf, start + head)
            n = len(buf) - start - head
            with memoryview(buf) as view:
                crc = zlib.crc32(view[start + head:])
            _HEAD_V2.pack_into(buf, start, n, n ^ _NOT, crc)
            return
        head = _HEAD.size
        buf.extend(bytes(head))
        self._enc.encode_into(obj, buf, start + head)
        n = len(buf) - start - head
        seq = self._seq & _NOT
        self._seq += 1
        with memoryview(buf) as view:
            crc = zlib.crc32(view[start + head:], zlib.crc32(_SEQ.pack(seq)))
        _HEAD.pack_into(buf, start, n, n ^ _NOT, seq, crc)

    def append(self, src: str, msg: Message, t: float | None = None) -> None:
        self._frame(Event(t=time.time() if t is None else t, src=src, msg=msg))
        self.frames += 1
        if len(self._buf) >= self._chunk:
            self.flush()

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def take(self) -> bytearray:
        """Detach the buffered frames (to be written by :meth:`write_raw`, possibly in another thread)."""
        buf, self._buf = self._buf, bytearray()
        return buf

    def write_raw(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.bytes_written += len(data)

    def flush(self) -> None:
        if self._buf:
            self.write_raw(self.take())

    def close(self, fsync: bool = True) -> None:
        if self._fd < 0:
            return
        self.flush()
        if fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEventLog:
    """The supervisor's tap: ``record`` is called on the event loop; a background task writes in a worker thread.

    ``record`` only encodes into memory; it awaits only when more than ``max_pending_bytes`` are waiting for the
    disk, which is the log's back-pressure on the graph.
    """

    def __init__(
        self,
        writer: EventLogWriter,
        *,
        flush_interval: float = 0.1,
        max_pending_bytes: int = 64 << 20,
    ) -> None:
        self.writer = writer
        self.flush_interval = flush_interval
        self.max_pending = max_pending_bytes
        self._wake = anyio.Event()
        self._lock = anyio.Lock()
        self.counts: Counter[str] = Counter()

    async def record(self, src: str, msg: Message) -> None:
        self._append(src, msg)
        if self.writer.pending_bytes > self.max_pending:
            self._wake.set()
            await self.flush()

    def record_nowait(self, src: str, msg: Message) -> None:
        self._append(src, msg)

    def _append(self, src: str, msg: Message) -> None:
        # Bypass the writer's own size-triggered flush: disk writes belong to the flusher thread here.
        w = self.writer
        w._frame(Event(t=time.time(), src=src, msg=msg))
        w.frames += 1
        self.counts[type(msg).__name__] += 1

    async def flush(self) -> None:
        async with self._lock:
            data = self.writer.take()
            if data:
                # Shielded: once taken out of the buffer, the frames must reach the file even if we are cancelled
                # before the worker thread starts.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.writer.write_raw, data)

    async def run_flusher(self) -> None:
        """Write buffered frames every ``flush_interval`` until cancelled; then write what is left."""
        try:
            while True:
                with anyio.move_on_after(self.flush_interval):
                    await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    def close(self) -> None:
        self.writer.close()


@dataclass
class ReadReport:
    frames: int = 0
    truncated_at: int | None = None  # byte offset of a cut last frame, if any
    problem: str = ""


class EventLogReader:
    """Iterate over a log's events. A cut last frame ends the iteration and is described in ``report``."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self._data = self.path.read_bytes()
        except FileNotFoundError:
            raise EventLogError(f"{self.path}: no such event log; pass the events.msgpack of a run directory") from None
        if self._data.startswith(MAGIC):
            self.version = 3
        elif self._data.startswith(MAGIC_V2):
            self.version = 2
        elif self._data.startswith(MAGIC_V1):
            self.version = 1
        else:
            raise EventLogError(f"{self.path}: not a bridle event log (missing {MAGIC!r} magic)")
        self.report = ReadReport()
        self.next_seq = 0  # v3: the sequence number the next frame must carry
        header_bytes, self._start = self._read_frame(len(MAGIC))
        if header_bytes is None:
            raise EventLogError(f"{self.path}: the header frame is cut; the log holds no events")
        try:
            self.header = msgspec.msgpack.decode(header_bytes, type=LogHeader)
        except msgspec.DecodeError as e:
            raise EventLogError(f"{self.path}: the header frame does not decode ({e}); not a readable log") from None
        if self.header.schema_version > SCHEMA_VERSION:
            raise EventLogError(
                f"{self.path}: schema version {self.header.schema_version} is newer than this bridle's "
                f"{SCHEMA_VERSION}; upgrade bridle to read it"
            )
        if self.header.schema_version < SCHEMA_VERSION:
            raise EventLogError(
                f"{self.path}: message schema {self.header.schema_version}, written by a bridle older than "
                f"2026-12-02; this one reads schema {SCHEMA_VERSION}: replay it with the bridle that wrote it"
            )
        self._log = get_logger(component="eventlog", path=str(self.path))

    def _read_frame(self, off: int) -> tuple[memoryview | None, int]:
        """(payload, offset after it), or (None, off) when the file ends inside this frame (a cut tail).

        Raises EventLogError for damage: a length that fails its check, a payload whose CRC is wrong, a sequence
        number out of order (v3), a length past the end with whole frames after it. A cut tail is the file's end
        inside its last frame (or a zero-filled end, what a power loss leaves); a torn final write (the very last
        frame with a wrong CRC) is one too."""
        data = self._data
        if self.version == 1:
            if off + 4 > len(data):
                return None, off
            (n,) = _LEN.unpack_from(data, off)
            end = off + 4 + n
            if n >= _MAX_FRAME or end > len(data):
                return None, off
            return memoryview(data)[off + 4 : end], end
        fmt = _HEAD if self.version == 3 else _HEAD_V2
        head = fmt.size
        if off + head > len(data):
            return self._tail(off, "its header")
        if self.version == 3:
            n, check, seq, crc = fmt.unpack_from(data, off)
        else:
            (n, check, crc), seq = fmt.unpack_from(data, off), None
        if n ^ _NOT != check:
            if self._zeros_from(off):
                return None, off
            raise EventLogError(f"{self.path}: frame at byte {off} is damaged (its length field fails its check); "
                                "the log is corrupt from there on")
        end = off + head + n
        if end > len(data):
            return self._tail(off, f"its {n} bytes")
        payload = memoryview(data)[off + head : end]
        got = zlib.crc32(payload) if seq is None else zlib.crc32(payload, zlib.crc32(_SEQ.pack(seq)))
        if got != crc:
            if end == len(data):
                return None, off
            raise EventLogError(f"{self.path}: frame at byte {off} is damaged (checksum mismatch); the log is "
                                "corrupt from there on")
        if seq is not None:
            if seq != self.next_seq and self._check_seq:
                raise EventLogError(
                    f"{self.path}: frame at byte {off} has sequence number {seq}, expected {self.next_seq}: "
                    f"{'frames are missing' if seq > self.next_seq else 'a frame is repeated'} before it; the log "
                    "is corrupt from there on")
            self.next_seq = seq + 1
            self._check_seq = True
        return payload, end

    _check_seq = True  # False while reading from a stored offset: its first frame sets the sequence

    def _zeros_from(self, off: int) -> bool:
        tail = memoryview(self._data)[off:]
        return len(tail) > 0 and tail.tobytes().count(0) == len(tail)

    def _tail(self, off: int, what: str) -> tuple[None, int]:
        """The file ends inside the frame at ``off`` (``what`` of it are missing): a cut tail, unless whole frames
        follow (a damaged length in the middle, which a resume must never truncate at)."""
        if not self._zeros_from(off):
            later = self._next_whole_frame(off + 1)
            if later is not None:
                raise EventLogError(
                    f"{self.path}: frame at byte {off} claims more than the file holds ({what}), yet a whole frame "
                    f"follows at byte {later}: the log is damaged there, not cut; it is corrupt from there on")
        return None, off

    def _next_whole_frame(self, start: int) -> int | None:
        """Offset of the first whole, checksum-valid frame at or after ``start``; None when there is none."""
        data = self._data
        fmt = _HEAD if self.version == 3 else _HEAD_V2
        arr = np.frombuffer(data, dtype=np.uint8)
        for r in range(4):  # every byte alignment: u32 words at offsets start + r + 4i
            base = start + r
            words = (len(data) - base) // 4
            if words < 2:
                continue
            w = arr[base : base + 4 * words].view("<u4")
            for i in np.flatnonzero((w[:-1] ^ w[1:]) == _NOT):
                off = base + 4 * int(i)
                if off + fmt.size > len(data):
                    continue
                fields = fmt.unpack_from(data, off)
                end = off + fmt.size + fields[0]
                if end > len(data):
                    continue
                payload = memoryview(data)[off + fmt.size : end]
                crc = (zlib.crc32(payload, zlib.crc32(_SEQ.pack(fields[2]))) if self.version == 3
                       else zlib.crc32(payload))
                if crc == fields[-1]:
                    return off
        return None

    @property
    def start_offset(self) -> int:
        """Offset of the first event frame (what a resume from the beginning would pass)."""
        return self._start

    def __iter__(self) -> Iterator[Event]:
        for _off, ev in self.iter_with_offsets():
            yield ev

    def iter_with_offsets(self, start: int | None = None) -> Iterator[tuple[int, Event]]:
        """Yield (offset just after the frame, event); the offset is what a checkpoint stores to resume from."""
        dec = msgspec.msgpack.Decoder(Event)
        off = self._start if start is None else start
        self._check_seq = start is None or start == self._start
        if start is None or start == self._start:
            self.next_seq = 1
        size = len(self._data)
        frames = 0
        while off < size:
            frame, end = self._read_frame(off)
            if frame is None:
                self._cut(off, f"last frame at byte {off} is cut ({size - off} bytes left); reading stops there")
                break
            try:
                ev = dec.decode(frame)
            except msgspec.DecodeError as e:
                if end == size and self.version == 1:
                    self._cut(off, f"last frame at byte {off} does not decode ({e}); reading stops there")
                    break
                raise EventLogError(f"{self.path}: frame at byte {off} does not decode: {e}") from e
            frames += 1
            off = end
            yield off, ev
        self.report.frames = frames

    def _cut(self, off: int, why: str) -> None:
        self.report.truncated_at = off
        self.report.problem = why
        self._log.warning("event log truncated", detail=why)


@dataclass
class LogSummary:
    path: str
    run_id: str
    experiment: str
    schema_version: int
    events: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    by_source: dict[str, int] = field(default_factory=dict)
    rollouts: int = 0
    groups: int = 0
    steps: int = 0  # RL steps the learner finished (PolicyUpdated.step >= 1)
    cold_start: bool = False  # the SFT update before them is logged (PolicyUpdated.step 0)
    last_policy_version: int | None = None
    first_t: float | None = None
    last_t: float | None = None
    truncated_at: int | None = None
    problem: str = ""
    statuses: dict[str, int] = field(default_factory=dict)  # rollouts by how they ended
    first_reasons: dict[str, str] = field(default_factory=dict)  # each failing status's first reason

    @property
    def span_s(self) -> float:
        if self.first_t is None or self.last_t is None:
            return 0.0
        return self.last_t - self.first_t

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["span_s"] = self.span_s
        return d


def summarize(path: Path | str) -> LogSummary:
    reader = EventLogReader(path)
    h = reader.header
    s = LogSummary(path=str(path), run_id=h.run_id, experiment=h.experiment, schema_version=h.schema_version)
    by_type: Counter[str] = Counter()
    by_src: Counter[str] = Counter()
    rollouts: set[str] = set()
    groups: set[str] = set()
    steps: set[int] = set()
    ends = Outcomes()
    for ev in reader:
        m = ev.msg
        if isinstance(m, RolloutFinished):
            ends.add(m)
        by_type[type(m).__name__] += 1
        by_src[ev.src] += 1
        if s.first_t is None:
            s.first_t = ev.t
        s.last_t = ev.t
        rid = getattr(m, "rollout_id", None)
        if rid:
            rollouts.add(rid)
        gid = getattr(m, "group_id", None)
        if gid:
            groups.add(gid)
        if type(m).__name__ == "PolicyUpdated":
            steps.add(m.step)  # type: ignore[union-attr]
            s.last_policy_version = m.version  # type: ignore[union-attr]
    s.events = sum(by_type.values())
    s.by_type = dict(sorted(by_type.items()))
    s.by_source = dict(sorted(by_src.items()))
    s.rollouts, s.groups, s.steps, s.cold_start = len(rollouts), len(groups), len(steps - {0}), 0 in steps
    s.statuses, s.first_reasons = dict(ends.counts.most_common()), dict(ends.first)
    s.truncated_at = reader.report.truncated_at
    s.problem = reader.report.problem
    return s
