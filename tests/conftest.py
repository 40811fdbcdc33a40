"""Shared fixtures: tiny random HF checkpoints (no download, seconds to build) and the
embedded SmolLM2."""
from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

# Chosen when @triton.jit runs, so it must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Set before collection too: some test modules ask at import whether the kernels build (see
# native_kernels).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CONVEYOR_KERNEL_CACHE", os.path.join(_REPO, "build", "kernels"))
# Tests must never reach the network, whatever a test asks transformers for.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from shared.model_source import ModelSource, resolve_model  # noqa: E402
from shared.protocol import Error, RequestOutput  # noqa: E402

if TYPE_CHECKING:
    from engine.models.llama import DecoderLayer, LlamaForCausalLM

T = TypeVar("T")

TINY: dict[str, Any] = dict(  # config keyword arguments of several types
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    # std 0.15 (HF's default is 0.02) keeps greedy output varied instead of one repeated
    # token, with top-1/top-2 logit gaps far above float noise, so greedy comparisons are not
    # decided by rounding.
    initializer_range=0.15,
)


def save_tiny(folder: Path, config_cls: type, model_cls: type, seed: int = 0, bias_std: float = 0.0,
              **overrides: object) -> Path:
    """Writes a tiny random checkpoint (config.json + model.safetensors) and returns its
    folder. bias_std: HF initialises q/k/v biases to zero; a nonzero draw makes the bias path
    really tested."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    if bias_std:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, bias_std)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def request_outputs(outs: Iterable[RequestOutput | Error]) -> list[RequestOutput]:
    """An engine step's (or abort's) outputs, asserted to be RequestOutputs: an Error
    fails the test."""
    rows = list(outs)
    assert all(isinstance(o, RequestOutput) for o in rows), rows
    return [o for o in rows if isinstance(o, RequestOutput)]


def present(value: T | None) -> T:
    """An optional field the test needs (an SDK response's usage or logprobs, an output's vector),
    asserted to be there: the SDKs type most response fields optional, the server must send them."""
    assert value is not None
    return value


def error_body(body: object) -> dict[str, Any]:
    """An SDK error's body (openai's and anthropic's APIStatusError type it object): the JSON object
    the server answered with."""
    assert isinstance(body, dict), body
    return body


def causal_lm(model: torch.nn.Module) -> LlamaForCausalLM:
    """A runner's model as the one graph class every architecture loads into: nn.Module's
    attribute access types each attribute as Tensor | Module, so tests that reach into layers go
    through here."""
    return cast("LlamaForCausalLM", model)


def decoder_layers(model: torch.nn.Module) -> list[DecoderLayer]:
    return [cast("DecoderLayer", layer) for layer in causal_lm(model).model.layers]


@pytest.fixture(scope="session", autouse=True)
def conveyor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Derived files (dequantized weights, tokenizer) go to a per-session folder, never the
    user's home."""
    path = tmp_path_factory.mktemp("conveyor-cache")
    old = os.environ.get("CONVEYOR_CACHE")
    os.environ["CONVEYOR_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("CONVEYOR_CACHE", None)
    else:
        os.environ["CONVEYOR_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def native_kernels(conveyor_cache: Path) -> bool:
    """Build the native CPU kernels once, before any test: every engine process the tests start then
    finds them in the cache instead of compiling them inside some test's deadline. The cache is the
    checkout's build/kernels (ignored by git), kept between sessions: a build is named by its
    sources, torch and CPU, so only a change to them compiles again (about 30 s a session saved)."""
    from kernels import cpu


    return cpu.available()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), Qwen2Config, Qwen2ForCausalLM, seed=2,
                     bias_std=0.1)


@pytest.fixture(scope="session")
def make_tiny_checkpoint():
    """save_tiny, for tests that need a variant (another RoPE scaling, tied embeddings, ...)."""
    return save_tiny


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(autouse=True)
def schedulers_never_stall(monkeypatch: pytest.MonkeyPatch):
    """Issue #14's watchdog, in every test: no scheduler a test builds may ever have had work
    waiting and nothing it could schedule (conveyor_engine_stalled_steps_total in a server)."""
    from engine.scheduler import Scheduler

    made: list[Scheduler] = []
    init = Scheduler.__init__

    def recording_init(self: Scheduler, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    schedule = Scheduler.schedule

    def watched_schedule(self: Scheduler) -> object:
        # A loop like `while core.has_work(): core.step()` would spin for ever on a stalled
        # scheduler: stop it.
        plan = schedule(self)
        assert self.num_stalled_steps < 100, (
            f"a scheduler stalled for {self.num_stalled_steps} steps with work waiting")
        return plan

    monkeypatch.setattr(Scheduler, "__init__", recording_init)
    monkeypatch.setattr(Scheduler, "schedule", watched_schedule)
    yield
    stalled = [s.num_stalled_steps for s in made if s.num_stalled_steps]
    assert not stalled, f"a scheduler stalled for {stalled} steps with work waiting"


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


COLLECT_FROM = 3 << 30  # the least resident size that a test may leave before a collection
COLLECT_SLACK = 1 << 30  # how far past the size the last collection left a test may grow it
collect_above = COLLECT_FROM


@pytest.fixture(autouse=True)
def free_dead_engines():
    """An engine's KV and swap pools (GiBs, written at start) live until the cyclic collector finds
    the engine, which a suite of few Python objects and many engines seldom runs: dead engines'
    pools then pile up in the one pytest process until the machine runs out of memory (21 GB was
    seen). Collect after a test that grew the process COLLECT_SLACK past what the last collection
    left (COLLECT_FROM at least). Not after every test once it is large: what stays (imports,
    torch's pools) kept it past 3 GiB, and a full collection of the suite's objects takes 1-6 s,
    which had become 60% of the suite's time. Reading the size costs microseconds."""
    global collect_above
    yield
    if resident_bytes() > collect_above:
        gc.collect()
        collect_above = max(COLLECT_FROM, resident_bytes() + COLLECT_SLACK)
