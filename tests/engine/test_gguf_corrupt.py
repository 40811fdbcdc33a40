"""A corrupt or truncated GGUF is refused at load by a real engine process, in one line naming the
file and the tensor (a corrupt one was served as healthy, answering garbage; a truncated one failed
with numpy's reshape message)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.engine.test_quantized import write_gguf

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny-q4.gguf")


def engine_refuses(model: Path, tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "engine", "--address", f"ipc://{tmp_path}/e.sock",
                           "--model", str(model), "--num-threads", "1", "--kv-cache-memory",
                           "16MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_gguf_with_garbage_in_a_tensor_is_refused_naming_it(tiny_gguf: Path,
                                                              tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    shutil.copy(tiny_gguf, bad)
    victim = next(t for t in GGUFReader(bad).tensors if t.name == "blk.0.ffn_down.weight")
    with open(bad, "r+b") as f:  # 0xFFFF is a NaN as float16: every block scale of this tensor
        f.seek(victim.data_offset)
        f.write(b"\xff" * int(victim.n_bytes))
    line = engine_refuses(bad, tmp_path)
    assert str(bad) in line and "blk.0.ffn_down.weight" in line and "non-finite" in line, line


def test_a_truncated_gguf_names_the_tensor_and_the_bytes_missing(tiny_gguf: Path,
                                                                 tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    data = tiny_gguf.read_bytes()
    bad.write_bytes(data[: len(data) - 1000])
    names = {t.name for t in GGUFReader(tiny_gguf).tensors}
    line = engine_refuses(bad, tmp_path)
    found = re.search(r"truncated GGUF: tensor (\S+) needs bytes (\d+)\.\.(\d+) and the file has "
                      r"(\d+): (\d+) bytes missing", line)
    assert found is not None and str(bad) in line, line
    name, _, end, size, missing = found.groups()
    assert name in names
    assert int(size) == bad.stat().st_size
    assert int(missing) == int(end) - int(size) > 0
