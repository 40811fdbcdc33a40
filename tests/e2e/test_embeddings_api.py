"""POST /v1/embeddings on a real `conveyor serve` (tiny random chat model, last-token pooling by
default): the official `openai` SDK (strings, token ids, base64), LangChain's OpenAIEmbeddings, 400s
that name the field, and every KV block back afterwards. The vectors are checked against
transformers' last hidden state of the same tokens."""

from __future__ import annotations

import asyncio
import base64
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import error_body
from tests.e2e.servers import Server, is_idle, tiny_serve, wait_engine_idle
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("embeddings") / "server.log"
    with Server(
        tiny_serve(tiny_chat_model, "--dtype", "float32", "--max-num-batched-tokens", "128"),
        log_path=log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: Path):
    """Token ids -> transformers' last hidden state of the last token, L2-normalised (what a decoder
    without sentence-transformers files is served with)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)

    return embed


def close(got: list[float], ref: torch.Tensor) -> bool:
    return float(F.cosine_similarity(torch.tensor(got), ref, dim=0)) > 0.9999


def test_strings_token_ids_and_usage(client: openai.OpenAI, reference) -> None:
    tok = smollm2_tokenizer()
    res = client.embeddings.create(
        model="tiny-chat", input=TEXTS, encoding_format="float", user="u-1"
    )
    assert (
        res.object == "list"
        and res.model == "tiny-chat"
        and [d.index for d in res.data] == [0, 1, 2]
    )
    ids = [tok.encode(t) for t in TEXTS]
    for d, x in zip(res.data, ids):
        assert (
            d.object == "embedding" and len(d.embedding) == 64 and close(d.embedding, reference(x))
        )
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="tiny-chat", input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(
        one.data[0].embedding, res.data[0].embedding, atol=1e-6
    )
    by_ids = client.embeddings.create(model="tiny-chat", input=ids, encoding_format="float")
    assert all(
        np.allclose(a.embedding, b.embedding, atol=1e-6) for a, b in zip(by_ids.data, res.data)
    )
    single = client.embeddings.create(
        model="tiny-chat", input=[5, 6, 7, 8], encoding_format="float"
    )
    assert (
        close(single.data[0].embedding, reference([5, 6, 7, 8])) and single.usage.prompt_tokens == 4
    )


def test_base64_is_float32_little_endian(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model="tiny-chat", input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model="tiny-chat", input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(
        model="tiny-chat", input=TEXTS
    )  # the SDK asks base64 and decodes it
    for f, r, d in zip(floats.data, raw.data, default.data):
        assert isinstance(r.embedding, str)
        decoded = np.frombuffer(base64.b64decode(r.embedding), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(f.embedding, dtype=np.float32))
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), decoded)


def test_long_input_chunked_and_truncated(client: openai.OpenAI, reference) -> None:
    """1024 tokens (the context) in 128-token chunks; 1100 is refused unless truncate_prompt_tokens
    asks, and then it is the last tokens that count."""
    ids = [(37 * i + 11) % 49000 for i in range(1100)]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny-chat", input=ids)
    body = error_body(e.value.body)
    assert body["param"] == "input" and "truncate_prompt_tokens" in body["message"]
    cut = client.embeddings.create(
        model="tiny-chat",
        input=ids,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 1024},
    )
    assert cut.usage.prompt_tokens == 1024 and close(cut.data[0].embedding, reference(ids[-1024:]))
    whole = client.embeddings.create(model="tiny-chat", input=ids[-1024:], encoding_format="float")
    assert np.allclose(whole.data[0].embedding, cut.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(input=""), "input"),
        (dict(input=[]), "input"),
        (dict(input=["ok", ""]), "input"),
        (dict(input=[[1, 2], []]), "input"),
        (dict(input=[1, 49152]), "input"),  # the vocabulary is 49152 tokens
        (dict(input="x", dimensions=16), "dimensions"),
        (dict(input="x", encoding_format="int8"), "encoding_format"),
        (dict(input="x", extra_body={"normalize": False}), "normalize"),
        (dict(input="x", extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, kwargs: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny-chat", **kwargs)
    body = error_body(e.value.body)
    assert body["param"] == param or param in body["message"], body


def test_langchain_openai_embeddings(
    server: Server, client: openai.OpenAI, tiny_chat_model: Path
) -> None:
    """LangChain's OpenAIEmbeddings: its tiktoken ids are OpenAI's vocabulary, so a served model
    takes text (check_embedding_ctx_length=False), or its own tokenizer's chunks
    (tiktoken_enabled=False)."""
    from langchain_openai import OpenAIEmbeddings

    kw: dict[str, Any] = dict(model="tiny-chat", base_url=f"{server.url}/v1", api_key="unused",
                              max_retries=0)
    want = [
        d.embedding
        for d in client.embeddings.create(
            model="tiny-chat", input=TEXTS, encoding_format="float"
        ).data
    ]
    plain = OpenAIEmbeddings(**kw, check_embedding_ctx_length=False)
    got = plain.embed_documents(TEXTS)
    assert len(got) == 3 and all(np.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    assert np.allclose(plain.embed_query(TEXTS[1]), want[1], atol=1e-5)
    assert np.allclose(asyncio.run(plain.aembed_query(TEXTS[2])), want[2], atol=1e-5)
    chunked = OpenAIEmbeddings(
        **kw,
        tiktoken_enabled=False,
        tiktoken_model_name=str(tiny_chat_model),
        embedding_ctx_length=1024,
    )
    tok = smollm2_tokenizer()
    resent = [
        tok.decode(tok.encode(t, add_special_tokens=False)) for t in TEXTS
    ]  # what LangChain sends
    want = [
        d.embedding
        for d in client.embeddings.create(
            model="tiny-chat", input=resent, encoding_format="float"
        ).data
    ]
    assert all(np.allclose(g, w, atol=1e-5) for g, w in zip(chunked.embed_documents(TEXTS), want))


def test_every_block_comes_back_and_metrics_count(server: Server, client: openai.OpenAI) -> None:
    client.embeddings.create(model="tiny-chat", input=TEXTS * 4)
    stats = asyncio.run(wait_engine_idle(server.engine_address, timeout=60))
    assert is_idle(stats), stats
    assert stats["total_embedding_requests"] >= 12
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    inputs = [
        line for line in text.splitlines() if line.startswith("conveyor_embedding_inputs_total")
    ]
    assert inputs and float(inputs[0].split()[-1]) >= 12


def test_a_server_that_cannot_pool_says_why(tiny_chat_model: Path, tmp_path: Path) -> None:
    with Server(
        tiny_serve(tiny_chat_model, "--pooling", "none", kv_cache="16MiB"),
        log_path=tmp_path / "server.log",
    ) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(
            openai.BadRequestError,
            match="cannot compute embeddings: it was started with --pooling none",
        ):
            c.embeddings.create(model="tiny-chat", input="hello")
        assert c.completions.create(
            model="tiny-chat", prompt="hello", max_tokens=2
        ).choices  # it still generates
