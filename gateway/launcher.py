"""Start the engine as a child process on an ipc:// address, and make sure it never outlives us.

Three ways a child could be orphaned, three guards: a normal exit stops it (SIGTERM, then SIGKILL after
a grace period); a gateway killed outright takes it along through PR_SET_PDEATHSIG (Linux); Ctrl-C in a
terminal reaches both, as they share the process group (start_new_session=False).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from shared.client import AsyncEngineClient
from shared.errors import EngineDead

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def default_address() -> str:
    return f"ipc:///tmp/conveyor-{os.getpid()}.sock"


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the other two guards remain
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class EngineProcess:
    def __init__(self, address: str, engine_args: list[str], stop_timeout: float = 10.0) -> None:
        self.address = address
        self.argv = [sys.executable, "-m", "engine", "--address", address, *engine_args]
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """The child inherits stderr, so model loading shows its own progress in the terminal."""
        self._remove_ipc_file()
        parent = os.getpid()
        preexec = (lambda: _die_with_parent(parent)) if sys.platform.startswith("linux") else None
        log.info("starting engine: %s", " ".join(self.argv))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, start_new_session=False, preexec_fn=preexec)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def wait_ready(self, client: AsyncEngineClient, timeout: float) -> None:
        """HELLO/READY with the child's death as a second way out: a child that crashes while loading
        the model fails start-up at once instead of after the whole timeout."""
        start = asyncio.ensure_future(client.start(timeout=timeout))
        while not start.done():
            await asyncio.wait({start}, timeout=0.2)
            code = self.exit_code()
            if code is not None and not start.done():
                start.cancel()
                raise EngineDead(f"the engine exited with code {code} before it was ready (its error is above)")
        start.result()

    async def watch(self, on_exit: asyncio.Event) -> None:
        """While serving: an engine that dies takes the gateway down, rather than serving 503s forever."""
        while self.exit_code() is None:
            await asyncio.sleep(0.5)
        log.error("the engine exited with code %s", self.exit_code())
        on_exit.set()

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine ignored SIGTERM for %gs; killing it", self.stop_timeout)
                proc.kill()
                proc.wait()
        self._remove_ipc_file()

    def _remove_ipc_file(self) -> None:
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
