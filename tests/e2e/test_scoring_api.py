"""Scoring through the official `openai` SDK against a real `conveyor serve` (float32 tiny model):
echo with logprobs and max_tokens 0, batched prompts, vLLM's prompt_logprobs; the numbers are
transformers'."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import present
from tests.e2e.servers import Server
from tests.fakes import smollm2_tokenizer
from tests.reference import hf_folder_model

pytestmark = pytest.mark.slow
TOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a land far away"]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("scoring") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "64MiB", "--dtype", "float32", "--max-num-batched-tokens",
                 "16"], log_path=log) as srv:
        yield srv  # 16-token chunks: every prompt here is scored over several steps


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(tiny_chat_model: Path):
    """ids -> transformers' log_softmax [P, V] of the same float32 weights."""
    model = hf_folder_model(tiny_chat_model)

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp


def check_echo_logprobs(lp, ids: list[int], logp: torch.Tensor, k: int) -> None:
    tok = smollm2_tokenizer()
    strings = [tok.decode([t]) for t in ids]
    assert lp.tokens[:len(ids)] == strings
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offsets = [sum(len(s) for s in strings[:j]) for j in range(len(ids))]
    assert lp.text_offset[:len(ids)] == offsets
    for j in range(1, len(ids)):
        row = logp[j - 1]
        assert abs(lp.token_logprobs[j] - row[ids[j]].item()) < TOL
        vals, top = row.topk(k)
        want = {tok.decode([t]): v for t, v in zip(top.tolist(), vals.tolist())}
        got = lp.top_logprobs[j]
        assert set(want) <= set(got) and len(got) <= k + 1
        assert all(abs(got[s] - v) < TOL for s, v in want.items())
        assert strings[j] in got  # the prompt token itself, always


def test_echo_scoring_without_generating_equals_transformers(client: openai.OpenAI, ref) -> None:
    tok = smollm2_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    for prompt in (TEXTS, ids):  # a batch of strings, and of token-id lists
        resp = client.completions.create(model="tiny-chat", prompt=prompt, echo=True, logprobs=1,
                                         max_tokens=0)
        assert [c.index for c in resp.choices] == [0, 1]
        usage = present(resp.usage)
        assert usage.completion_tokens == 0 and usage.prompt_tokens == sum(map(len, ids))
        for c, p, text in zip(resp.choices, ids, TEXTS):
            assert c.text == text and c.finish_reason == "length"
            assert len(present(present(c.logprobs).tokens)) == len(p)
            check_echo_logprobs(c.logprobs, p, ref(p), k=1)


def test_echo_with_generation_puts_the_prompt_first(client: openai.OpenAI, ref) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", prompt=TEXTS[1], max_tokens=5, temperature=0,
                              logprobs=3, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    ids = smollm2_tokenizer().encode(TEXTS[1])
    assert echoed.text == TEXTS[1] + plain.text
    assert echoed.logprobs.tokens == echoed.logprobs.tokens[:len(ids)] + plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert echoed.logprobs.text_offset[len(ids)] == sum(len(s)
                                                        for s in echoed.logprobs.tokens[:len(ids)])
    check_echo_logprobs(echoed.logprobs, ids, ref(ids), k=3)
    parts = list(client.completions.create(**kw, echo=True, stream=True))
    assert parts[0].choices[0].text.startswith(TEXTS[1])  # the prompt goes first
    assert "".join(p.choices[0].text for p in parts) == echoed.text
    streamed = [t for p in parts if p.choices[0].logprobs
                for t in p.choices[0].logprobs.token_logprobs]
    assert streamed == echoed.logprobs.token_logprobs


def test_batched_prompts_generate_one_choice_per_prompt_and_n(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", max_tokens=4, temperature=0.8, seed=5, n=2,
                              extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=TEXTS, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, text in enumerate(TEXTS):
        alone = client.completions.create(prompt=text, **kw)
        assert [c.text for c in alone.choices] == [c.text for c in batch.choices[2 * i:2 * i + 2]]
    assert batch.usage.completion_tokens == 16
    parts = list(client.completions.create(prompt=TEXTS, stream=True,
                                           stream_options={"include_usage": True}, **kw))
    by_index: dict[int, str] = {}
    for p in parts:
        for c in p.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {c.index: c.text for c in batch.choices}
    assert parts[-1].usage.completion_tokens == 16 and all(p.id == parts[0].id for p in parts)


def test_vllm_prompt_logprobs_on_completions_and_chat(client: openai.OpenAI, ref) -> None:
    ids = smollm2_tokenizer().encode(TEXTS[0])
    resp = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})
    got = resp.model_dump()["choices"][0]["prompt_logprobs"]
    logp = ref(ids)
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry = got[j]
        mine = entry[str(ids[j])]
        assert abs(mine["logprob"] - logp[j - 1, ids[j]].item()) < TOL
        # vLLM's rank: 1 + the tokens scored above it. A token within TOL of it may fall on either
        # side of it in another float32 summation order, so the rank is pinned to that band.
        target = logp[j - 1, ids[j]]
        above = int((logp[j - 1] > target + TOL).sum())
        near = int((logp[j - 1] > target - TOL).sum()) - 1  # the token itself is within TOL
        assert above + 1 <= mine["rank"] <= near + 1, (mine["rank"], above, near)
        top = logp[j - 1].topk(2).indices.tolist()
        assert all(entry[str(t)]["rank"] == r for r, t in enumerate(top, start=1))
        assert len(entry) <= 3
    chat = client.chat.completions.create(model="tiny-chat",
                                          messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    plist = chat.model_dump()["prompt_logprobs"]
    assert plist[0] is None and all(len(e) == 1 for e in plist[1:])


@pytest.mark.parametrize("kw, param, needle", [
    (dict(prompt=[]), "prompt", "non-empty"),
    (dict(prompt=[[1, 2], [3, 10**6]]), "prompt", "prompt[1]"),
    (dict(prompt="hi", max_tokens=0), "max_tokens", "echo=true"),
    (dict(prompt="hi", echo=True, stream=True, extra_body={"prompt_logprobs": 1}),
     "prompt_logprobs", "stream"),
    (dict(prompt="hi", echo=True, logprobs=21), "logprobs", "[0, 20]"),
], ids=["empty-batch", "token-out-of-vocabulary", "max-tokens-0-without-echo",
        "prompt-logprobs-stream",
        "logprobs-range"])
def test_bad_scoring_input_is_a_400_naming_the_field(client: openai.OpenAI, kw: dict, param: str,
                                                     needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-chat", **kw)
    assert info.value.param == param and needle in info.value.message
