"""Read back what W&B wrote offline (``<run>/wandb/offline-run-*/run-<id>.wandb``), as ``wandb sync`` would upload
it: W&B's log file (a 7-byte header, then LevelDB-style records in 32 KiB blocks, each a serialized
``wandb_internal_pb2.Record``), without a server."""

import glob
import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7  # ":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B log"
    out, parts, off = [], [], HEADER
    while off + 7 <= len(data):
        room = BLOCK - off % BLOCK
        if room < 7:  # the block's tail is padding
            off += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, off)
        chunk = data[off + 7: off + 7 + length]
        off += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            out.append(b"".join([*parts, chunk]))
    return out


def offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Every offline run W&B wrote under ``run_dir`` (a resumed run writes another, with the same id), in order."""
    return [offline_run(Path(p)) for p in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))]


def offline_run(path: Path) -> dict[str, Any]:
    """One offline run's ids, config and history rows (each a dict of the logged keys)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"history": [], "config": {}, "ids": set()}
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "run":
            out["ids"].add(rec.run.run_id)
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    return out
