"""End-to-end fixtures: a tiny random chat model that real server processes load in seconds."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import smollm2_tokenizer

# SmolLM2's tokenizer (vocab 49152, chat template, <|im_end|> = 2) over a tiny random Llama: real
# text in and out of a real engine, a step in milliseconds.
TINY_CHAT = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory,
                    make_tiny_checkpoint: Callable[..., Path]) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("models") / "tiny-chat"
    make_tiny_checkpoint(folder, LlamaConfig, LlamaForCausalLM, seed=3, **TINY_CHAT)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_offline(tiny_chat_model: Path) -> Callable[[list[str], int], list[str]]:
    """Greedy texts of the tiny chat model from the offline API, in this process: the reference that
    streams through real servers must equal. (prompts, max_tokens) -> texts."""
    import torch

    from engine.offline import LLM
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(str(tiny_chat_model), num_threads=1, kv_cache_memory="16MiB")
    tok = smollm2_tokenizer()

    def generate(prompts: list[str], max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([tok.encode(p) for p in prompts], params, use_tqdm=False)
        return [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]

    return generate


async def stream_completion(session, url: str, prompt: str, max_tokens: int) -> str:
    """Greedy SSE completion -> its text; asserts the stream ends with [DONE]."""
    import orjson

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", raw[-300:]
    return "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1])


@pytest.fixture(scope="module")
def engine_address(server: Any) -> str:
    """The engine address of the module's `server` fixture (a tests.e2e.servers.Server)."""
    return str(server.engine_address)
