"""Grammar compiles in processes of their own, so that one can be stopped: xgrammar's compile is one
C++ call that no thread can interrupt, and a 900-deep JSON schema runs for minutes and grows the
memory of whoever runs it.

One compile server process (started on the first constrained request: importing xgrammar takes
seconds) holds xgrammar and the tokenizer's compiler, and forks a child per compile, at most
`workers` at once: a fork starts in milliseconds, and killing it loses nothing. A child over its
time budget is killed and its request gets a 400; so is one over its memory budget (RLIMIT_AS, set
in the child to what it has plus the budget), and one whose requests all went away (CANCEL) is
killed without an answer.

The pipes carry frames (4-byte big-endian length + bytes), never pickles:
  engine -> server: the TokenizerInfo as xgrammar's JSON once, then JSON {"id", "kind", "value"} (a
                    compile, shared/constraints.py kinds) or {"id", "cancel": true};
  server -> engine: per compile, JSON {"id", "error": str | null}, then (no error) the grammar's
                    JSON.

Run as `python -m engine.grammar_worker WORKERS TIMEOUT MAX_BYTES`; nothing here imports torch
itself.
"""
from __future__ import annotations

import json
import os
import re
import resource
import select
import signal
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

# "[17:18:13] /project/cpp/x.cc:83: " before a message
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}


def what(kind: str) -> str:
    return _WHAT.get(kind, kind)


def write_frame(out: IO[bytes], data: bytes) -> None:
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def _read_exact(f: IO[bytes], n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame(f: IO[bytes]) -> bytes:
    """EOFError when the other end is gone."""
    (n,) = struct.unpack(">I", _read_exact(f, 4))
    return _read_exact(f, n)


def _compile(compiler: Any, kind: str, value: str) -> Any:
    if kind == "json":
        # any_whitespace=False: compact JSON. With free whitespace a small model under greedy
        # decoding can emit newlines forever, never closing the object (vLLM offers the same
        # switch).
        return compiler.compile_json_schema(value, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":  # a grammar of string literals; json.dumps escapes as EBNF reads them
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s)
                                                                 for s in json.loads(value)))
    if kind == "grammar":
        return compiler.compile_grammar(value)
    return compiler.compile_structural_tag(value)


def _child(compiler: Any, job: dict[str, Any], out: IO[bytes], max_bytes: int) -> None:
    """In the forked child: compile, write the answer (header + grammar) to out."""
    if max_bytes > 0:
        with open("/proc/self/statm") as f:
            have = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (have + max_bytes, have + max_bytes))
    try:
        text = _compile(compiler, job["kind"], job["value"]).serialize_json()
    except MemoryError:
        error = {"error": f"compiling it needs more than {max_bytes >> 20} MiB"}
        write_frame(out, json.dumps(error).encode())
        return
    # BLE001: the compiler's own exception types vary; the message is the point
    except Exception as e:
        message = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip()
                                  else type(e).__name__)
        write_frame(out, json.dumps({"error": f"invalid {what(job['kind'])}: {message}"}).encode())
        return
    write_frame(out, b'{"error": null}')
    write_frame(out, text.encode())


@dataclass
class _Running:
    job: dict[str, Any]
    pid: int
    fd: int  # the read end of the child's answer pipe
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class _Server:
    """The compile server's loop: jobs from stdin, one forked child each (at most `workers` at
    once), answers relayed to stdout when a child's pipe closes."""

    def __init__(self, compiler: Any, workers: int, timeout: float, max_bytes: int) -> None:
        self.compiler, self.workers = compiler, workers
        self.timeout, self.max_bytes = timeout, max_bytes
        self.queue: deque[dict[str, Any]] = deque()
        self.running: dict[int, _Running] = {}  # by read fd
        self.out = sys.stdout.buffer

    def answer(self, job_id: int, error: str | None, payload: bytes = b"") -> None:
        write_frame(self.out, json.dumps({"id": job_id, "error": error}).encode())
        if error is None:
            write_frame(self.out, payload)

    def fork(self, job: dict[str, Any]) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the loop
            os.close(r)
            code = 0
            try:
                with os.fdopen(w, "wb") as out:
                    _child(self.compiler, job, out, self.max_bytes)
            except BaseException:  # a child must end here, whatever happened
                code = 1
            os._exit(code)
        os.close(w)
        self.running[r] = _Running(job, pid, r, time.monotonic() + self.timeout)

    def end(self, run: _Running, kill: bool) -> None:
        if kill:
            os.kill(run.pid, signal.SIGKILL)
        os.waitpid(run.pid, 0)
        os.close(run.fd)
        del self.running[run.fd]

    def finish(self, run: _Running) -> None:
        """Its pipe closed: relay what it wrote (a header and maybe a grammar) or say it died."""
        self.end(run, kill=False)
        data = bytes(run.data)
        try:
            (n,) = struct.unpack(">I", data[:4])
            head = json.loads(data[4:4 + n])
        except (struct.error, ValueError):
            self.answer(run.job["id"],
                        f"compiling this {what(run.job['kind'])} exceeded the compiler's memory "
                        f"budget ({self.max_bytes >> 20} MiB): simplify it")
            return
        if head["error"] is not None:
            self.answer(run.job["id"], head["error"])
        else:
            self.answer(run.job["id"], None, data[8 + n:])

    def take(self, msg: dict[str, Any]) -> None:
        if not msg.get("cancel"):
            self.queue.append(msg)
            return
        self.queue = deque(j for j in self.queue if j["id"] != msg["id"])
        for run in [r for r in self.running.values() if r.job["id"] == msg["id"]]:
            self.end(run, kill=True)

    def serve(self, stdin: IO[bytes]) -> None:
        while True:
            while self.queue and len(self.running) < self.workers:
                self.fork(self.queue.popleft())
            now = time.monotonic()
            for run in [r for r in self.running.values() if r.deadline <= now]:
                self.end(run, kill=True)
                self.answer(run.job["id"],
                            f"compiling this {what(run.job['kind'])} took longer than its "
                            f"{self.timeout:g}s budget (--grammar-compile-timeout): simplify it")
            wait = min((r.deadline for r in self.running.values()), default=now + 3600) - now
            ready, _, _ = select.select([stdin.fileno(), *self.running], [], [], max(wait, 0.0))
            for fd in ready:
                if fd == stdin.fileno():
                    try:
                        self.take(json.loads(read_frame(stdin)))
                    except EOFError:  # the engine is gone
                        for run in list(self.running.values()):
                            self.end(run, kill=True)
                        return
                elif fd in self.running:
                    chunk = os.read(fd, 1 << 20)
                    if chunk:
                        self.running[fd].data += chunk
                    else:
                        self.finish(self.running[fd])


def main() -> None:
    workers, timeout, max_bytes = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    import xgrammar as xgr

    stdin = os.fdopen(0, "rb", buffering=0)  # unbuffered: select() sees every frame that waits
    info = xgr.TokenizerInfo.deserialize_json(read_frame(stdin).decode())
    # No cache here: the engine caches compiled grammars, and this process must not grow with them.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _Server(compiler, workers, timeout, max_bytes).serve(stdin)


if __name__ == "__main__":
    main()
