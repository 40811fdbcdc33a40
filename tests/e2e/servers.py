"""Real server processes for end-to-end tests: started as a user starts them, always torn down.

Each server runs in a session of its own (its own process group), so teardown can take the whole
tree down with one killpg even when the gateway is wedged; the engine child shares that group.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONVEYOR = str(Path(sys.executable).with_name("conveyor"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct child processes of pid, from /proc (every thread's children file)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return sorted(set(out))


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited already
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


class Server:
    """`conveyor <argv...> --port P` as a subprocess; `with Server(...) as s:` waits for /health."""

    def __init__(self, argv: list[str], *, port: int | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 ready_timeout: float = 180.0, exact_argv: bool = False,
                 health_path: str | None = "/ready") -> None:
        """argv: the arguments of `conveyor`, to which `--port` is added; exact_argv: the whole
        command line as given (port included). health_path None: a process without HTTP (an engine),
        ready at once."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = list(argv) if exact_argv else [CONVEYOR, *argv, "--port", str(self.port)]
        self.health_path = health_path
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._descendants: set[int] = set()

    def __enter__(self) -> Server:
        if self.proc is None:
            self.start()
        try:
            self.wait_healthy(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def engine_address(self) -> str:
        """Where `conveyor serve` binds the engine it starts (gateway/launcher.py
        default_address)."""
        return f"ipc:///tmp/conveyor-{self.pid}.sock"

    def start(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, start_new_session=True)
        if self.log_path:
            log.close()  # type: ignore[union-attr]

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"healthy:\n{self.log()}")
            self.remember_descendants()
            if self.health_path is None:
                return
            try:
                if get_json(f"{self.url}{self.health_path}", timeout=2)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not healthy after {timeout:g}s:\n{self.log()}")

    def remember_descendants(self) -> set[int]:
        """Descendant pids seen so far; teardown checks each of them is gone, not only
        the gateway."""
        todo = [self.pid]
        while todo:
            for c in children(todo.pop()):
                if c not in self._descendants:
                    self._descendants.add(c)
                    todo.append(c)
        return set(self._descendants)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, as a user's Ctrl-C or `docker stop` would; SIGKILL the group if that fails.
        Returns the gateway's exit code (None when it had to be killed) and raises if any process
        outlived it."""
        if self.proc is None:
            return None
        self.remember_descendants()
        code: int | None = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(timeout)
        else:
            code = self.proc.returncode
        left = wait_gone(sorted(self._descendants), 10.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # the whole session, whatever state it is in
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        if left:
            raise AssertionError(f"processes outlived the server and had to be killed: {left}")
        return code


def get_json(url: str, timeout: float = 10.0,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


async def engine_stats(address: str, curve_keys: str | Path | None = None) -> dict[str, float]:
    from shared.client import AsyncEngineClient

    async with AsyncEngineClient(address, name="e2e-test", ready_timeout=120,
                                 curve_keys=curve_keys) as client:
        return await client.get_stats()


async def wait_engine_idle(address: str, timeout: float = 20.0,
                           curve_keys: str | Path | None = None) -> dict[str, float]:
    """Polls the engine until it holds no request and every KV block is free; returns the last
    stats. curve_keys: the client key folder, for an engine started with --curve-keys."""
    from shared.client import AsyncEngineClient

    async with AsyncEngineClient(address, name="e2e-test", ready_timeout=120,
                                 curve_keys=curve_keys) as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = await client.get_stats()
            if is_idle(stats) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)


def is_idle(stats: dict[str, float]) -> bool:
    """No request in the engine, every device block free, and every CPU (swap) block free
    where there are."""
    return (stats["num_running"] == 0 and stats["num_waiting"] == 0
            and stats.get("num_swapped", 0) == 0 and stats["num_free_blocks"] == stats["num_blocks"]
            and stats.get("num_free_cpu_blocks", 0) == stats.get("num_cpu_blocks", 0))


def tiny_serve(model: Path, *flags: str, kv_cache: str = "64MiB") -> list[str]:
    """`conveyor serve` arguments for a tiny checkpoint as the e2e tests start it: one compute
    thread (the test and other servers share the cores) and a small KV pool; flags: what the
    test is about."""
    return ["serve", "--model", str(model), "--num-threads", "1", "--kv-cache-memory", kv_cache,
            *flags]
