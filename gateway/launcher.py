"""Start the engine as a child process on an ipc:// address, and make sure it never outlives us.

Three ways a child could be orphaned, three guards: a normal exit stops it (SIGTERM, then SIGKILL
after a grace period); a gateway killed outright takes it along through PR_SET_PDEATHSIG (Linux); a
signal to the whole process group reaches both, as they share it (start_new_session=False).

Except Ctrl-C: the terminal sends SIGINT to the whole group, and the engine ignores it (set between
fork and exec; exec keeps an ignored signal, and Python then installs no KeyboardInterrupt handler).
The gateway alone handles it and stops the engine with one SIGTERM, waiting for it to exit: an
engine that got both signals was interrupted a second time inside its own shutdown (a traceback from
torch, a --trace-file never written).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.client import AsyncEngineClient
from shared.errors import EngineDead

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def default_address() -> str:
    return f"ipc:///tmp/conveyor-{os.getpid()}.sock"


def _die_with_parent(parent_pid: int, cpus: set[int] | None = None) -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies (and
    bind the child to `cpus`, inherited by every thread it starts)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the other two guards remain
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _engine_child(parent_pid: int, cpus: set[int] | None) -> None:
    """Runs in the engine child between fork and exec: the terminal's SIGINT is the gateway's to
    handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid, cpus)


class EngineProcess:
    def __init__(self, address: str, engine_args: list[str], stop_timeout: float = 10.0,
                 cpus: set[int] | None = None) -> None:
        self.address = address
        self.cpus = cpus  # bind the engine to these cores (data-parallel replicas never share one)
        self.argv = [sys.executable, "-m", "engine", "--address", address, *engine_args]
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """The child inherits stderr, so model loading shows its own progress in the terminal."""
        self._remove_ipc_file()
        parent = os.getpid()
        linux = sys.platform.startswith("linux")
        preexec = (lambda: _engine_child(parent, self.cpus)) if linux else None
        log.info("starting engine: %s", " ".join(self.argv))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, start_new_session=False,
                                     preexec_fn=preexec)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def wait_ready(self, client: AsyncEngineClient, timeout: float) -> None:
        """HELLO/READY with the child's death as a second way out: a child that crashes while
        loading the model fails start-up at once instead of after the whole timeout."""
        start = asyncio.ensure_future(client.start(timeout=timeout))
        try:
            while not start.done():
                await asyncio.wait({start}, timeout=0.2)
                code = self.exit_code()
                if code is not None and not start.done():
                    raise EngineDead(f"the engine exited with code {code} before it was ready (its "
                                     "error is above)")
        # also when this wait is cancelled (Ctrl-C while loading): the handshake's outcome is moot
        finally:
            if not start.done():
                start.cancel()
            start.add_done_callback(lambda f: f.cancelled() or f.exception())
        start.result()

    def stop(self) -> None:
        if self.proc is not None:
            terminate([self.proc], self.stop_timeout, "the engine")
        self._remove_ipc_file()

    def _remove_ipc_file(self) -> None:
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)


def keep_off_engine_cpus(engine_pid: int, pids: list[int]) -> set[int] | None:
    """Bind every thread of `pids` to the CPUs no thread of the engine is bound to, when there are
    such CPUs: an engine with fewer compute threads than cores (--num-threads) has its OpenMP
    threads bound one per core, and HTTP work on those cores would slow its steps. -> the CPUs used,
    None when nothing changed (the engine uses every core, or this is not Linux)."""
    try:
        engine = set().union(*(os.sched_getaffinity(int(t))
                               for t in os.listdir(f"/proc/{engine_pid}/task")))
        rest = os.sched_getaffinity(0) - engine
    except (AttributeError, OSError):
        return None
    if not rest:
        return None
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:  # the process ended meanwhile: the watcher of workers reports it
            continue
        for tid in tids:
            # later threads inherit it from the one that starts them; a thread may have ended
            # meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), rest)
    return rest


class WorkerProcesses:
    """Extra gateway processes of `conveyor serve --gateway-workers N`: each connects its own
    DEALER to the engine and binds the same port with SO_REUSEPORT, so the kernel spreads
    connections over them."""

    def __init__(self, argvs: list[list[str]], env: dict[str, str] | None = None,
                 stop_timeout: float = 10.0) -> None:
        self.argvs = argvs
        self.env = env
        self.stop_timeout = stop_timeout
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failed = False
        self._ready_fds: list[int] = []

    def start(self) -> None:
        """Each worker gets the write end of a pipe (--ready-fd) and writes one line
        to it once it serves."""
        parent = os.getpid()
        preexec = (lambda: _die_with_parent(parent)) if sys.platform.startswith("linux") else None
        for argv in self.argvs:
            r, w = os.pipe()
            log.info("starting gateway worker: %s", " ".join(argv))
            self.procs.append(subprocess.Popen([*argv, "--ready-fd", str(w)],
                                               stdin=subprocess.DEVNULL, env=self.env,
                                               preexec_fn=preexec, pass_fds=(w,)))
            os.close(w)
            self._ready_fds.append(r)

    def wait_ready(self, timeout: float) -> None:
        """Blocks until every worker serves; EngineDead when one exits first or the timeout
        passes."""
        deadline = time.monotonic() + timeout
        pending = list(self._ready_fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDead(f"{len(pending)} gateway worker(s) not serving after {timeout:g}s")
            readable, _, _ = select.select(pending, [], [], min(left, 0.5))
            for fd in readable:
                if not os.read(fd, 64):
                    raise EngineDead("a gateway worker exited before it served (its error is "
                                     "above)")
                pending.remove(fd)
                os.close(fd)
        self._ready_fds = []

    async def watch(self, on_exit: asyncio.Event) -> None:
        """A worker that dies takes the whole server down (its share of the port would be lost
        otherwise); the supervisor above (systemd, compose, k8s) restarts it whole."""
        while all(p.poll() is None for p in self.procs):
            await asyncio.sleep(0.5)
        dead = [(p.pid, p.returncode) for p in self.procs if p.poll() is not None]
        log.error("gateway worker(s) exited: %s", dead)
        self.failed = True
        on_exit.set()

    def stop(self) -> None:
        terminate(self.procs, self.stop_timeout, "gateway worker")


def terminate(procs: list[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    """SIGTERM all (so they shut down in parallel), then wait; kill whoever ignores it past
    timeout."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s %d ignored SIGTERM for %gs; killing it", what, p.pid, timeout)
            p.kill()
            p.wait()
