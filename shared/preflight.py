"""Checks that run before a model loads: a mistake a user can fix in a second must not cost
them a model load first and a traceback after it. Each returns one line saying what is wrong,
or None. No torch here."""
from __future__ import annotations

import os
import socket


def check_writable(path: str, flag: str = "--trace-file") -> str | None:
    """Whether path can be written (it is created, left empty, if it does not exist; never
    truncated)."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e})"
    if not existed:
        os.unlink(path)
    return None


def check_port(host: str, port: int, reuse_port: bool = False) -> str | None:
    """Whether host:port can be bound now, as the HTTP server will bind it (SO_REUSEADDR, and
    SO_REUSEPORT when several processes share the port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"--host {host}: {e.strerror or e}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                s.bind(addr)
            except OSError as e:
                return (f"cannot listen on {host}:{port}: {e.strerror or e} (another server "
                        "there? pick --port)")
    return None
