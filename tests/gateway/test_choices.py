"""n, best_of, logprobs and beam search over HTTP and WebSocket, against a fake engine: OpenAI's
shapes, one detokenizer and stop-string hold-back per choice, logprobs aligned with the text they
come with, and the 400s (the real-engine side is tests/e2e/test_openai_choices.py)."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tests.fakes import FakeEngine, fake_logprobs, smollm2_tokenizer
from tests.gateway.test_routes import gateway, run, sse_events

TEXTS = [" The capital of France is Paris. 你好", " Once upon a time there was a cat",
         " Paris is nice"]
CHAT = [{"role": "user", "content": "Capital?"}]


def ids(text: str) -> list[int]:
    return smollm2_tokenizer().encode(text)


def three_choices(add: Any) -> list[list[int]]:
    return [ids(t) for t in TEXTS[:add.params.n]]


async def post(http: Any, path: str, body: dict[str, Any]) -> Any:
    resp = await http.post(path, json=body)
    assert resp.status == 200, await resp.text()
    if body.get("stream"):
        events = sse_events(await resp.read())
        assert events[-1] == b"[DONE]"
        return [orjson.loads(e) for e in events[:-1]]
    return await resp.json()


def by_index(chunks: list[dict[str, Any]], key: str) -> dict[int, list[dict[str, Any]]]:
    """Stream chunks -> per choice index, its choice objects in order (each chunk carries one)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for c in chunks:
        assert len(c["choices"]) <= 1
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).append(ch)
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n3_whole_response_has_three_indexed_choices_and_summed_usage(chat: bool) -> None:
    async def main() -> None:
        with FakeEngine(choices=three_choices, tokens_per_step=2) as eng:
            async with gateway(eng) as http:
                body = {"messages": CHAT} if chat else {"prompt": "Capital?"}
                resp = await post(http, "/v1/chat/completions" if chat else "/v1/completions",
                                  {**body, "n": 3, "max_tokens": 50})
        assert eng.adds()[0].params.n == 3
        assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
        texts = [c["message"]["content"] if chat else c["text"] for c in resp["choices"]]
        assert texts == TEXTS
        assert [c["finish_reason"] for c in resp["choices"]] == ["stop"] * 3
        assert all(c["logprobs"] is None for c in resp["choices"])
        assert resp["usage"]["completion_tokens"] == sum(len(ids(t)) for t in TEXTS)
    run(main())


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n2_stream_has_chunks_for_both_indices(chat: bool) -> None:
    async def main() -> None:
        with FakeEngine(choices=three_choices) as eng:
            async with gateway(eng) as http:
                body = {"messages": CHAT} if chat else {"prompt": "Capital?"}
                chunks = await post(http, "/v1/chat/completions" if chat else "/v1/completions",
                                    {**body, "n": 2, "max_tokens": 50, "stream": True,
                                     "stream_options": {"include_usage": True}})
        choices = by_index(chunks[:-1], "delta" if chat else "text")
        assert sorted(choices) == [0, 1]
        for i, parts in choices.items():
            text = "".join((p["delta"].get("content") or "") if chat else p["text"] for p in parts)
            assert text == TEXTS[i]
            assert [p["finish_reason"] for p in parts] == [None] * (len(parts) - 1) + ["stop"]
            if chat:
                assert parts[0]["delta"]["role"] == "assistant"
                assert all("role" not in p["delta"] for p in parts[1:])
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == len(ids(TEXTS[0])) + len(ids(TEXTS[1]))
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_apply_per_choice(stream: bool) -> None:
    """Choice 0 meets "Paris" in the middle, choice 2 at once, choice 1 never (and runs longest):
    nobody sees "Paris"; each choice a stop string ends is ended in the engine at once (its blocks
    free while the others run), and the whole request is aborted there only when stop strings end
    every choice."""
    long = [ids(" The capital of France is Paris.") * 6, ids(TEXTS[1]) * 6,
            ids(" Paris is nice") * 8]

    async def main() -> None:
        with FakeEngine(choices=lambda add: long, step_interval=0.005) as eng:
            async with gateway(eng) as http:
                got = await post(http, "/v1/completions",
                                 {"prompt": "Capital?", "n": 3, "max_tokens": 100, "stop": "Paris",
                                  "stream": stream})
                if stream:
                    texts = {i: "".join(p["text"] for p in parts)
                             for i, parts in by_index(got, "text").items()}
                    reasons = {i: parts[-1]["finish_reason"]
                               for i, parts in by_index(got, "text").items()}
                else:
                    texts = {c["index"]: c["text"] for c in got["choices"]}
                    reasons = {c["index"]: c["finish_reason"] for c in got["choices"]}
                assert texts == {0: " The capital of France is ", 1: TEXTS[1] * 6, 2: " "}
                assert reasons == {0: "stop", 1: "stop", 2: "stop"}
                first = eng.adds()[0].request_id
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.stopped_choices) >= 2)
                assert sorted(eng.stopped_choices) == [(first, 0), (first, 2)]
                # choice 1 ran to its end: the engine finished the request itself
                assert eng.aborted == []
                got = await post(http, "/v1/completions",
                                 {"prompt": "Capital?", "n": 2, "max_tokens": 100,
                                  "stop": ["Paris", "there"], "stream": stream})
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.aborted) == 1)
                second = eng.adds()[1].request_id
                assert eng.aborted == [second]  # both choices stopped: the engine stops too
                assert [c for c in eng.stopped_choices
                        if c[0] == second] in ([(second, 0)], [(second, 1)])
    run(main())


def test_completion_logprobs_match_the_engine_and_follow_the_text() -> None:
    text = " The capital of France is Paris."
    toks = ids(text)

    async def main() -> None:
        with FakeEngine(tokens=toks) as eng:
            async with gateway(eng) as http:
                body = {"prompt": "Capital?", "max_tokens": 50, "logprobs": 2}
                whole = (await post(http, "/v1/completions", body))["choices"][0]
                chunks = await post(http, "/v1/completions", {**body, "stream": True})
        assert eng.adds()[0].params.logprobs == 2
        lp = whole["logprobs"]
        assert whole["text"] == text and "".join(lp["tokens"]) == text
        assert lp["tokens"] == [smollm2_tokenizer().decode([t]) for t in toks]
        assert lp["token_logprobs"] == [fake_logprobs(t, i, 2)[0] for i, t in enumerate(toks)]
        tok = smollm2_tokenizer()
        assert lp["top_logprobs"] == [{tok.decode([a]): v for a, v in fake_logprobs(t, i, 2)[1]}
                                      for i, t in enumerate(toks)]
        assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i])
                                     for i in range(len(toks))]
        # Streamed: each chunk carries the logprobs of its own tokens; together they are the whole.
        for c in chunks:
            ch = c["choices"][0]
            assert "".join(ch["logprobs"]["tokens"]) == ch["text"]
        joined = {k: [v for c in chunks for v in c["choices"][0]["logprobs"][k]] for k in lp}
        assert joined == lp
    run(main())


def test_chat_logprobs_shape() -> None:
    text = " Once upon a time"
    toks = ids(text)

    async def main() -> None:
        with FakeEngine(tokens=toks) as eng:
            async with gateway(eng) as http:
                body = {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "n": 2}
                whole = await post(http, "/v1/chat/completions", body)
                chunks = await post(http, "/v1/chat/completions", {**body, "stream": True})
                plain = await post(http, "/v1/chat/completions",
                                   {"messages": CHAT, "logprobs": True})
        assert [a.params.logprobs for a in eng.adds()] == [3, 3, 0]
        tok = smollm2_tokenizer()
        for choice in whole["choices"]:
            content = choice["logprobs"]["content"]
            assert [e["token"] for e in content] == [tok.decode([t]) for t in toks]
            for i, (e, t) in enumerate(zip(content, toks)):
                lp, top = fake_logprobs(t, i, 3)
                assert e["logprob"] == lp and e["bytes"] == list(e["token"].encode())
                assert e["top_logprobs"] == [{"token": tok.decode([a]), "logprob": v,
                                              "bytes": list(tok.decode([a]).encode())}
                                             for a, v in top]
        for i, parts in by_index(chunks, "delta").items():
            assert [e for p in parts
                    for e in p["logprobs"]["content"]] == whole["choices"][i]["logprobs"]["content"]
        assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    run(main())


@pytest.mark.parametrize("stop, text", [
    # Held back token by token as a possible stop string, then released at once with its logprobs.
    ([" France is Paris!"], " The capital of France is Paris."),
    # Cut: the tokens of the stop string go with their text.
    ([" Paris"], " The capital of France is"),
])
def test_logprobs_held_back_and_cut_with_their_text(stop: list[str], text: str) -> None:
    async def main() -> None:
        with FakeEngine(tokens=ids(" The capital of France is Paris.")) as eng:
            async with gateway(eng) as http:
                chunks = await post(http, "/v1/completions",
                                    {"prompt": "Capital?", "max_tokens": 50, "logprobs": 1,
                                     "stop": stop, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        for c in chunks:
            assert "".join(c["choices"][0]["logprobs"]["tokens"]) == c["choices"][0]["text"]
        if "!" in stop[0]:
            assert [" France", " is", " Paris", "."] in [c["choices"][0]["logprobs"]["tokens"]
                                                         for c in chunks]
    run(main())


def test_split_characters_bring_their_tokens_along() -> None:
    """你 is two byte tokens: the first carries no text alone, so its logprob waits for the
    second."""
    toks = ids(" 你好")

    async def main() -> None:
        with FakeEngine(tokens=toks) as eng:
            async with gateway(eng) as http:
                chunks = await post(http, "/v1/completions",
                                    {"prompt": "hi", "max_tokens": 50, "logprobs": 0,
                                     "stream": True})
        tok = smollm2_tokenizer()
        # prefix text -> how many tokens make it up, for the prefixes that end on a whole character
        whole = {tok.decode(toks[:m]): m for m in range(len(toks) + 1)
                 if "\ufffd" not in tok.decode(toks[:m])}
        # " ", " 你", " 你好": the two characters are two tokens each
        assert len(whole) == 4 and len(toks) == 5
        text, count = "", 0
        # merge-proof: after each chunk, the tokens sent are exactly those of the text sent
        for c in chunks:
            text += c["choices"][0]["text"]
            count += len(c["choices"][0]["logprobs"]["tokens"])
            assert whole[text] == count
        assert text == " 你好"
    run(main())


@pytest.mark.parametrize("path, body, want", [
    ("/v1/completions", {"best_of": 3}, {"best_of": 3, "n": 1}),
    ("/v1/completions", {"n": 2, "best_of": 4, "logprobs": 0},
     {"best_of": 4, "n": 2, "logprobs": 0}),
    ("/v1/completions", {"n": 2, "use_beam_search": True, "best_of": 4, "length_penalty": 0.5},
     {"use_beam_search": True, "beam_width": 4, "n": 2, "best_of": None, "length_penalty": 0.5}),
    ("/v1/completions", {"use_beam_search": True, "n": 3, "early_stopping": "never",
                         "stream": True},
     {"use_beam_search": True, "beam_width": 3, "early_stopping": "never"}),
    ("/v1/chat/completions", {"n": 2, "use_beam_search": True, "beam_width": 5},
     {"beam_width": 5, "n": 2}),
    ("/v1/chat/completions", {"logprobs": False, "speculative": False},
     {"logprobs": None, "speculative": False}),
    ("/v1/completions", {"n": 2, "best_of": 2, "stream": True}, {"best_of": 2, "n": 2}),
])
def test_fields_reach_the_engine_as_sampling_params(path: str, body: dict[str, Any],
                                                    want: dict[str, Any]) -> None:
    async def main() -> None:
        with FakeEngine(tokens=ids(" hi there")) as eng:
            async with gateway(eng) as http:
                base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
                resp = await http.post(path, json={**base, "max_tokens": 4, **body})
                assert resp.status == 200, await resp.text()
                await resp.read()
        params = eng.adds()[0].params
        assert {k: getattr(params, k) for k in want} == want
    run(main())


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "best_of must be >= n"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of", "cannot stream"),
    ("/v1/completions", {"n": 0}, "n", "[1, 64]"),
    ("/v1/completions", {"n": 65}, "n", "[1, 64]"),
    ("/v1/completions", {"n": True}, "n", "integer"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", "chat parameter"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs",
     "logprobs=true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "true or false"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of", "/v1/completions parameter"),
    ("/v1/completions", {"use_beam_search": True, "n": 3, "beam_width": 2}, "n", "beam_width"),
    ("/v1/completions", {"use_beam_search": 1}, "use_beam_search", "true or false"),
    ("/v1/completions", {"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping",
     "never"),
    ("/v1/completions", {"suffix": "tail"}, "suffix", "not supported"),
    ("/v1/chat/completions", {"use_beam_search": True, "logprobs": True}, "logprobs",
     "beam search"),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty", "use_beam_search=true"),
    ("/v1/chat/completions", {"beam_width": 4, "use_beam_search": False}, "beam_width",
     "use_beam_search=true"),
])
def test_refusals(path: str, body: dict[str, Any], param: str, needle: str) -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng) as http:
                base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
                resp = await http.post(path, json={**base, **body})
                assert resp.status == 400, await resp.text()
                err = (await resp.json())["error"]
                assert err["param"] == param and needle in err["message"], err
                assert eng.adds() == []
    run(main())


def test_websocket_streams_choices_and_logprobs_as_sse_does() -> None:
    async def main() -> None:
        with FakeEngine(choices=three_choices) as eng:
            async with gateway(eng) as http:
                body = {"prompt": "Capital?", "n": 2, "max_tokens": 50, "logprobs": 1,
                        "stop": "Paris"}
                sse = await post(http, "/v1/completions", {**body, "stream": True})
                ws = await http.ws_connect("/v1/ws")
                await ws.send_json({"op": "completions", "id": "a", "body": body})
                frames = []
                while (frame := await asyncio.wait_for(ws.receive_json(), 10))["event"] == "chunk":
                    frames.append(frame["data"])
                assert frame == {"id": "a", "event": "done"}
                await ws.close()

        def per_choice(chunks: list[dict[str, Any]]) -> dict[int, tuple[str, list[str], str]]:
            return {i: ("".join(p["text"] for p in parts),
                        [t for p in parts for t in p["logprobs"]["tokens"]],
                        parts[-1]["finish_reason"])
                    for i, parts in by_index(chunks, "text").items()}
        got = per_choice(frames)
        assert got == per_choice(sse)
        assert got[0][0] == " The capital of France is " and got[1][0] == TEXTS[1]
        # The " Paris" token carried the stop string: it goes; its leading space went out already.
        assert "".join(got[0][1]) == " The capital of France is" and got[0][2] == "stop"
    run(main())
