"""Native CPU kernels, built on first use with the machine's C++ compiler and cached on disk.

The build is one g++ call against torch's own headers and libraries (no ninja, no setuptools): the
kernels are compiled for the CPU they run on (-march=native), so the cache key holds the CPU's flags
as well as the source and torch's version, and a cache copied to another machine is rebuilt, never
run. Linking the OpenMP runtime by name reuses the one torch has loaded, so at::parallel_for shares
torch's threads. Where no compiler is present the caller falls back to PyTorch ops (available() says
so).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sysconfig
import time
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("conveyor.kernels")
SOURCES = [Path(__file__).with_name(n)
           for n in ("paged_attention.cpp", "layer_ops.cpp", "quant_gemm.cpp",
                      "quant_gemm_rows.cpp", "quant_int8.cpp", "quant_int8_avx2.cpp",
                      "quant_gemm_avx512.cpp", "quant_gemm_avx2.cpp", "quant_gemm_avx2_q8.cpp",
                      "decoder_layers.cpp")]
# included by the sources: part of the cache key
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-DNDEBUG", "-w"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    """CONVEYOR_KERNEL_CACHE, else CONVEYOR_CACHE's kernels folder. A build's name holds its
    key (sources, torch, CPU flags, compiler flags), so one folder can serve every test
    session and checkout."""
    own = os.environ.get("CONVEYOR_KERNEL_CACHE")
    if own:
        return Path(own)
    root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
    return root / "kernels"


def _command(out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()],
            f"-I{sysconfig.get_paths()['include']}", *map(str, SOURCES), "-o", str(out),
            *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-ltorch"]


def build() -> Path:
    """-> the shared library, compiled now if this source, torch and CPU have no cached build."""
    key = hashlib.sha256()
    for part in [*(s.read_bytes() for s in [*SOURCES, *HEADERS]), torch.__version__.encode(),
                 _cpu_flags().encode(), " ".join(FLAGS).encode()]:
        key.update(part)
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"conveyor_cpu-{key.hexdigest()[:16]}.so"
    # one build at a time across processes; the others wait
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            log.info("compiling the CPU attention kernel (first start on this machine, ~30 s)")
            start, tmp = time.monotonic(), lib.with_suffix(f".{os.getpid()}.tmp")
            done = subprocess.run(_command(tmp), capture_output=True, text=True)
            if done.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"building {SOURCES[0].name} failed:\n{done.stderr[-3000:]}")
            tmp.rename(lib)
            log.info("compiled the CPU attention kernel in %.1f s", time.monotonic() - start)
    return lib


@cache
def available() -> bool:
    """Whether the native kernels are loaded (built if needed); False, logged once,
    where they cannot be."""
    if os.environ.get("CONVEYOR_NATIVE_KERNELS", "1") == "0":
        return False
    try:
        torch.ops.load_library(str(build()))
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("native CPU kernels unavailable, attention falls back to PyTorch ops: %s", err)
        return False
