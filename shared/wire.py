"""The wire's limits, its heartbeat and its CURVE keys: what both ends set on their ZeroMQ sockets.

Every socket is bounded (docs/reliability.md, "The wire's limits"):
- a message larger than its receiver's MAXMSGSIZE is refused by ZeroMQ itself, which drops that
  connection (the peer reconnects); the SDK checks the size of what it sends against the limit the
  engine announces in READY first, so its users get InvalidRequest instead;
- a queue past its high-water mark makes the sender wait (client -> engine: back-pressure) or, for
  the engine's outputs, makes the engine drop that one client's requests explicitly
  (engine/loop.py).

CURVE (ZeroMQ's public-key encryption and authentication) is on when an engine is given a key
folder: `conveyor keys DIR` writes DIR/engine (the engine's key pair + the public keys of the
clients it admits) and DIR/client (a client's key pair + the engine's public key); each side is
pointed at its own folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth

AnySocket = zmq.Socket[bytes] | zmq.asyncio.Socket

# The engine sends each client with requests in flight a HEARTBEAT at most this often (seconds),
# between steps; the client declares the engine lost after ENGINE_TIMEOUT of silence with requests
# in flight. The timeout must be longer than the engine's longest step (a step cannot be interrupted
# to send one).
HEARTBEAT_INTERVAL = 1.0
DEFAULT_ENGINE_TIMEOUT = 5.0

# The engine's inbound message limit, from the config: an ADD is the largest message a client sends.
# Its prompt is at most max_model_len ids of at most 11 bytes of JSON each ("4294967295,"): 12
# leaves room. Everything else (request id, scalar parameters, stop strings, stop token ids, logit
# bias) gets a fixed 1 MiB: far above what an OpenAI-sized request carries (4 stop strings, 300
# logit_bias entries: ~10 kB).
BYTES_PER_PROMPT_TOKEN = 12
PARAMS_ROOM = 2**20
# A client's inbound limit guards it against garbage, not a real message: an engine's largest, one
# OUTPUTS of every sequence of a step with 20 top logprobs for 17 tokens (speculative), is ~10 kB a
# sequence, so 64 MiB holds thousands of sequences' rows.
CLIENT_MAX_MESSAGE_SIZE = 64 * 2**20
# Messages queued per peer, each way. The engine sends a client one OUTPUTS per step: 1000 is
# seconds of steps that client has not read (its reader merges deltas as they come, so a live one
# never falls behind); past it the engine drops that client's requests rather than grow its memory.
# A client may have 1000 messages on their way to the engine before its sends wait (back-pressure;
# the engine drains them in steps, engine/loop.py MAX_DRAIN_PER_STEP at a time).
HWM = 1000
# ZeroMQ's own keepalive on the connection (answered by its I/O thread): a peer whose host vanished
# without closing TCP is disconnected after ZMTP_TIMEOUT instead of after the kernel's ~15 minutes,
# so a client reconnects to an engine restarted elsewhere and the engine forgets a vanished client.
ZMTP_HEARTBEAT_MS = 1000
ZMTP_TIMEOUT_MS = 10_000

ENGINE_KEY = "engine"  # DIR/engine/engine.key_secret, DIR/client/engine.key
CLIENT_KEY = "client"  # DIR/client/client.key_secret, DIR/engine/client.key


def max_message_size(max_model_len: int) -> int:
    """The engine's MAXMSGSIZE: the largest ADD a request the engine can serve makes, with room."""
    return PARAMS_ROOM + BYTES_PER_PROMPT_TOKEN * max_model_len


def bound(sock: AnySocket, max_message_size: int) -> None:
    """Limits and ZeroMQ keepalives on a socket; before bind/connect (they apply to new
    connections)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMTP_TIMEOUT_MS)


@dataclass(frozen=True)
class Keys:
    """One side's CURVE keys: its own pair, and the engine's public key (a client
    needs it to connect)."""

    public: bytes
    secret: bytes
    engine_public: bytes
    folder: Path  # the engine admits the clients whose public keys (*.key) lie here


def load_keys(folder: str | os.PathLike[str], side: str) -> Keys:
    """side "engine": FOLDER/engine.key_secret (+ the admitted clients' *.key);
    "client": FOLDER/client.key_secret and FOLDER/engine.key. ValueError saying what is
    missing and how to make it."""
    path = Path(folder)
    own = path / f"{ENGINE_KEY if side == 'engine' else CLIENT_KEY}.key_secret"
    engine = path / f"{ENGINE_KEY}.key{'_secret' if side == 'engine' else ''}"
    for f in (own, engine):
        if not f.is_file():
            raise ValueError(f"CURVE keys: {f} is missing: `conveyor keys DIR` writes DIR/engine "
                             "for the engine and DIR/client for its clients")
    public, secret = zmq.auth.load_certificate(own)
    engine_public, _ = zmq.auth.load_certificate(engine)
    assert secret is not None  # a *.key_secret file holds both keys
    return Keys(public, secret, engine_public, path)


def generate_keys(folder: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Writes FOLDER/engine and FOLDER/client (as load_keys reads them) -> those two folders.
    Refuses to overwrite keys that exist: clients holding the old public key would be locked out."""
    root = Path(folder)
    engine_dir, client_dir = root / ENGINE_KEY, root / CLIENT_KEY
    for d in (engine_dir, client_dir):
        if d.exists() and any(d.iterdir()):
            raise ValueError(f"{d} is not empty: keys exist already (remove it to make new ones)")
        d.mkdir(parents=True, exist_ok=True)
    engine_pub, engine_sec = (Path(p) for p in zmq.auth.create_certificates(engine_dir, ENGINE_KEY))
    client_pub, client_sec = (Path(p) for p in zmq.auth.create_certificates(client_dir, CLIENT_KEY))
    (client_dir / engine_pub.name).write_bytes(engine_pub.read_bytes())
    (engine_dir / client_pub.name).write_bytes(client_pub.read_bytes())
    for secret in (engine_sec, client_sec):
        secret.chmod(0o600)
    return engine_dir, client_dir


def serve_curve(sock: AnySocket, keys: Keys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect_curve(sock: AnySocket, keys: Keys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.engine_public
