"""n, best_of, logprobs and beam search through the official `openai` package against a real
`conveyor serve` (tiny random chat model), each compared with the same model's engine run in
this process."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shared.sampling import SamplingParams
from tests.conftest import present, request_outputs
from tests.e2e.servers import Server
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a story."}]
PROMPT = "Once upon a time"
Reference = Callable[[list[int], SamplingParams],
                     dict[int, tuple[list[int], list[list[Any]] | None]]]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("choices") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB"], log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_chat_model: Path) -> Reference:
    """The same model in-process: prompt ids + params -> per choice index, (token ids,
    logprobs rows)."""
    import torch

    from engine.core import EngineCore
    from shared.config import build_config

    torch.set_num_threads(1)
    core = EngineCore(build_config(str(tiny_chat_model), num_threads=1, kv_cache_memory="16MiB"))
    count = iter(range(10**6))

    def generate(prompt_ids: list[int], params: SamplingParams
                 ) -> dict[int, tuple[list[int], list[list[Any]] | None]]:
        rid = f"ref-{next(count)}"
        out: dict[int, tuple[list[int], list[list[Any]] | None]] = {}
        core.add(rid, prompt_ids, params)
        while core.has_work():
            for o in request_outputs(core.step()):
                ids, lps = out.setdefault(o.index, ([], [] if o.logprobs is not None else None))
                ids += o.new_token_ids
                if o.logprobs is not None:
                    present(lps).extend(o.logprobs)
        return out
    return generate


def prompt_ids(server: Server, **body: Any) -> list[int]:
    """The server's own tokenization of a prompt or of chat messages (with the
    generation prompt)."""
    req = urllib.request.Request(f"{server.url}/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["tokens"]


def texts_of(ref: dict[int, tuple[list[int], Any]]) -> list[str]:
    tok = smollm2_tokenizer()
    return [tok.decode(ref[i][0], skip_special_tokens=True) for i in sorted(ref)]


def test_n3_seeded_choices_equal_the_engine(client: openai.OpenAI, server: Server,
                                            engine: Reference) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    ref = texts_of(engine(prompt_ids(server, prompt=PROMPT), params))
    assert len(set(ref)) == 3  # three different samples, so the indices below are really checked
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, n=3, temperature=1.0, seed=7,
                                    max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == ref
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    usage = present(out.usage)
    assert usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24

    ref = texts_of(engine(prompt_ids(server, messages=CHAT), params))
    chat = client.chat.completions.create(model="tiny-chat", messages=CHAT, n=3, temperature=1.0,
                                          seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and [c.message.content
                                                             for c in chat.choices] == ref
    assert present(chat.usage).completion_tokens == 24


def test_best_of_returns_the_engines_best(client: openai.OpenAI, server: Server,
                                          engine: Reference) -> None:
    params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    ref = texts_of(engine(prompt_ids(server, prompt=PROMPT), params))
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, n=1, best_of=3,
                                    temperature=1.0, seed=3, max_tokens=6,
                                    extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in out.choices] == [(0, ref[0])]
    assert present(out.usage).completion_tokens == 6  # the returned choice's tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_n2_equals_the_whole_response(client: openai.OpenAI, chat: bool) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", n=2, temperature=1.0, seed=11, max_tokens=10,
                              extra_body={"ignore_eos": True})
    create = client.chat.completions.create if chat else client.completions.create
    kw |= {"messages": CHAT} if chat else {"prompt": PROMPT}
    whole = create(**kw)
    want = [c.message.content if chat else c.text for c in whole.choices]
    assert len(want) == 2 and want[0] != want[1]
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if chat else c.text)
            reasons[c.index] = c.finish_reason
    assert texts == {0: want[0], 1: want[1]} and reasons == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 20 == whole.usage.completion_tokens


def test_completion_logprobs_equal_the_engine(client: openai.OpenAI, server: Server,
                                              engine: Reference) -> None:
    ids = prompt_ids(server, prompt=PROMPT)
    ref_ids, ref_lps = engine(ids,
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             logprobs=2))[0]
    out = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=8, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    choice, tok = out.choices[0], smollm2_tokenizer()
    lp, ref_rows = present(choice.logprobs), present(ref_lps)
    tokens, tops = present(lp.tokens), present(lp.top_logprobs)
    assert tokens == [tok.decode([t]) for t in ref_ids]
    assert "".join(tokens) == choice.text
    assert lp.token_logprobs == pytest.approx([row[0] for row in ref_rows], abs=1e-4)
    assert [len(top) for top in tops] == [2] * 8  # greedy: the sampled token is the top one
    for top, row in zip(tops, ref_rows):
        assert top == pytest.approx({tok.decode([t]): v for t, v in row[1]}, abs=1e-4)
    assert lp.text_offset == [sum(len(s) for s in tokens[:i]) for i in range(8)]


def test_chat_logprobs_equal_the_engine(client: openai.OpenAI, server: Server,
                                        engine: Reference) -> None:
    ref_ids, ref_lps = engine(prompt_ids(server, messages=CHAT),
                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             logprobs=2))[0]
    out = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content, tok = present(present(out.choices[0].logprobs).content), smollm2_tokenizer()
    ref_rows = present(ref_lps)
    assert [e.token for e in content] == [tok.decode([t]) for t in ref_ids]
    assert "".join(e.token for e in content) == out.choices[0].message.content
    assert [e.logprob for e in content] == pytest.approx([row[0] for row in ref_rows], abs=1e-4)
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2 for e in content)
    assert [[a.logprob for a in e.top_logprobs] for e in content] == \
        [pytest.approx([v for _, v in row[1]], abs=1e-4) for row in ref_rows]


def test_beam_search_equals_the_engine(client: openai.OpenAI, server: Server,
                                       engine: Reference) -> None:
    params = SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=8, ignore_eos=True)
    ref = texts_of(engine(prompt_ids(server, prompt=PROMPT), params))
    out = client.completions.create(model="tiny-chat", prompt=PROMPT, n=2, max_tokens=8,
                                    extra_body={"use_beam_search": True, "beam_width": 3,
                                                "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and [c.text for c in out.choices] == ref


def test_stop_string_applies_to_each_choice(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", prompt=PROMPT, n=2, temperature=1.0, seed=5,
                              max_tokens=16, extra_body={"ignore_eos": True})
    full = [c.text for c in client.completions.create(**kw).choices]
    stop = full[0][len(full[0]) // 2:len(full[0]) // 2 + 2]
    assert stop.strip(), full
    for stream in (False, True):
        got: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        if stream:
            for chunk in client.completions.create(**kw, stop=stop, stream=True):
                for c in chunk.choices:
                    got[c.index] = got.get(c.index, "") + c.text
                    reasons[c.index] = c.finish_reason
        else:
            for c in client.completions.create(**kw, stop=stop).choices:
                got[c.index], reasons[c.index] = c.text, c.finish_reason
        for i, text in enumerate(full):
            cut = text.find(stop)
            assert got[i] == (text if cut < 0 else text[:cut]) and stop not in got[i]
            assert reasons[i] == ("length" if cut < 0 else "stop")


@pytest.mark.parametrize("call, param", [
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", n=3, best_of=2), "best_of"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", best_of=2, stream=True),
     "best_of"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=CHAT, top_logprobs=2),
     "top_logprobs"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", logprobs=21), "logprobs"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=CHAT, logprobs=True,
                                         top_logprobs=21),
     "top_logprobs"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", n=0), "n"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=CHAT, n=0), "n"),
], ids=["best_of<n", "stream-best_of>n", "top_logprobs-alone", "logprobs-range",
        "top_logprobs-range", "n=0",
        "chat-n=0"])
def test_refusals(client: openai.OpenAI, call: Callable[[openai.OpenAI], object],
                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    assert info.value.param == param
