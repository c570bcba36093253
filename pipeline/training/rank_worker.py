"""One learner rank, started by Accelerate's launcher (:func:`pipeline.training.ranks.start_ranks`): connects to
the actor's Unix socket, says which rank it is, then runs each command it is sent on its
:class:`pipeline.training.learner.Learner` and replies (metrics, or the traceback of what failed). Ends on
``Shutdown`` or when the channel closes (the run is gone)."""

from __future__ import annotations

import argparse
import os
import socket
import traceback

import msgspec
import structlog

from pipeline.core.logs import configure, get_logger
from pipeline.training import ranks as proto


def _read_exactly(f, n: int) -> bytes | None:
    data = f.read(n)
    if len(data) < n:
        return None  # the actor closed the channel
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    configure(level=args.log_level)

    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from pipeline.training.learner import Learner

    if args.threads:
        torch.set_num_threads(args.threads)
    # joins the launcher's process group; on CPU (ACCELERATE_USE_CPU, set by start_ranks) a gloo one
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    structlog.contextvars.bind_contextvars(rank=state.process_index)
    log = get_logger(actor="learner")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    f = sock.makefile("rb")
    sock.sendall(proto.frame(proto.Hello(rank=state.process_index, ranks=state.num_processes, pid=os.getpid())))
    log.info("learner rank ready", ranks=state.num_processes, device=str(state.device))
    decoder = msgspec.msgpack.Decoder(proto.Command)
    learner: Learner | None = None
    while True:
        header = _read_exactly(f, proto._HEADER)
        body = None if header is None else _read_exactly(f, int.from_bytes(header, "big"))
        if body is None:
            log.warning("learner channel closed; rank exiting")
            return
        cmd = decoder.decode(body)
        reply = proto.Reply()
        try:
            if isinstance(cmd, proto.Init):
                learner = None  # the old stage's model and optimizer go before the new ones are built
                learner = Learner(cmd.model, cmd.config)
            elif isinstance(cmd, proto.Shutdown):
                pass
            elif learner is None:
                raise RuntimeError(f"{type(cmd).__name__} before Init: the rank has no learner yet")
            elif isinstance(cmd, proto.TrainStep):
                reply.metrics = learner.train_step(cmd.groups)
            elif isinstance(cmd, proto.SftStep):
                reply.metrics = learner.sft_step(cmd.groups)
            elif isinstance(cmd, proto.SaveWeights):
                learner.save_weights(cmd.path, cmd.version)
            elif isinstance(cmd, proto.SaveCheckpoint):
                learner.save_checkpoint(cmd.path, cmd.extra)
            elif isinstance(cmd, proto.LoadCheckpoint):
                reply.extra = learner.load_checkpoint(cmd.path)
            if learner is not None:
                reply.step, reply.version = learner.step, learner.version
        except Exception:  # noqa: BLE001 — the actor fails the run with this traceback
            reply.error = traceback.format_exc()
            log.error("learner rank command failed", command=type(cmd).__name__, error=reply.error)
        sock.sendall(proto.frame(reply))
        if isinstance(cmd, proto.Shutdown):
            return


if __name__ == "__main__":
    main()
