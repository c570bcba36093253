#!/usr/bin/env python3
"""TCP 127.0.0.1:PORT -> Unix socket forwarder, standard library only (bridle's base image, /opt/bridle).

A sandbox on network ``none`` has only its own loopback; the bridle proxy's Unix socket is bind-mounted into it.
Unmodified harnesses want an http:// URL, so this relays every TCP connection on the container's loopback to that
socket, byte for byte, in both directions.

    forwarder.py --listen 127.0.0.1:8080 --socket /run/bridle/proxy.sock                # serve forever
    forwarder.py --listen 127.0.0.1:8080 --socket /run/bridle/proxy.sock -- CMD ARGS...  # serve, then exec CMD

With a command, the listening socket is bound before the command starts (so its first request cannot race the
forwarder), a forked child serves it (and dies with CMD), and this process becomes CMD: CMD's exit status is the
container's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading

BUFSIZE = 65536


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(BUFSIZE)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close so the peer sees end-of-request while its answer can still come back.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _relay(client: socket.socket, socket_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError as e:
        sys.stderr.write(f"forwarder: cannot reach {socket_path}: {e}\n")
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listener: socket.socket, socket_path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay, args=(client, socket_path), daemon=True).start()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the exec'd command) exits."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host or "127.0.0.1", int(port)))
    s.listen(128)
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:8080", help="host:port to accept TCP connections on")
    p.add_argument("--socket", required=True, help="the Unix socket to relay to")
    args = p.parse_args(argv)
    listener = bind(args.listen)
    if not command:
        serve(listener, args.socket)
        return 0
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        # Child: the relay. It dies with CMD (also outside a container), but not of SIGTERM sent to CMD's group.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.setsid()
        _die_with_parent()
        if os.getppid() != parent:
            os._exit(0)
        try:
            serve(listener, args.socket)
        finally:
            os._exit(0)
    listener.close()
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"forwarder: cannot run {command[0]!r}: {e}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
