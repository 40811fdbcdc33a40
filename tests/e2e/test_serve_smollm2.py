"""`conveyor serve` with the real SmolLM2 as a user starts it: separate processes, concurrent
streams that match the offline API, disconnect -> abort with every block freed, and bad input
answered with 400s.

One server for the whole module (start-up is the expensive part: ~25 s cold on 2 cores).
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from shared.sampling import SamplingParams
from shared.tokenizer import apply_chat_template
from tests.e2e.servers import Server, children, cmdline, get_json, is_idle, wait_engine_idle
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
TOPICS = ["the capital of France", "photosynthesis", "the moon", "prime numbers",
          "a haiku about rain", "Python lists", "why the sky is blue", "gravity", "the number zero",
          "coffee", "volcanoes", "the ocean", "bees", "chess", "a limerick about cats",
          "the color green"]
# the other four sample (temperature 0.8, seeded): they must complete and read as text
GREEDY = set(range(12))


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me briefly about {TOPICS[i]}."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # parse the GGUF tokenizer once into the session cache; the gateway then reuses it
    smollm2_tokenizer()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # float32 pinned on both sides (auto is bfloat16 on AMX CPUs): greedy texts are
    # compared exactly.
    srv = Server(["serve", "--dtype", "float32", "--kv-cache-memory", "512MiB", "--num-threads",
                  "1", "--log-level", "info"], log_path=log)
    with srv:
        yield srv
    # Teardown is part of the contract: SIGTERM exits 0 (Server.stop raised already if any process
    # outlived it) and the engine removed its ipc socket file.
    assert srv.proc is not None and srv.proc.returncode == 0, srv.log()
    assert not Path(f"/tmp/conveyor-{srv.pid}.sock").exists()


@pytest.fixture(scope="module")
def offline_reference(server: Server) -> dict[int, str]:
    """Greedy texts from the offline API in this process, same chat-templated ids. Built after the
    server started, so the dequantized weights are in the cache already."""
    import torch

    from engine.offline import LLM

    torch.set_num_threads(1)
    tok = smollm2_tokenizer()
    llm = LLM(MODEL, dtype="float32", num_threads=1, kv_cache_memory="128MiB")
    prompts = [apply_chat_template(tok, messages(i)) for i in sorted(GREEDY)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    ref = {i: tok.decode(o.token_ids, skip_special_tokens=True)
           for i, o in zip(sorted(GREEDY), outs)}
    del llm
    return ref


def test_gateway_and_engine_are_separate_processes(server: Server, engine_address: str) -> None:
    kids = [pid for pid in children(server.pid) if "engine" in cmdline(pid)]
    assert len(kids) == 1, f"expected one engine child of the gateway {server.pid}, got {kids}"
    engine = kids[0]
    assert engine != server.pid
    argv = cmdline(engine)
    assert argv[1:3] == ["-m", "engine"] and engine_address in argv, argv
    status, models = get_json(f"{server.url}/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL


async def _stream_chat(session: aiohttp.ClientSession, url: str,
                       body: dict[str, Any]) -> tuple[str, list[bytes]]:
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), events
    payloads = [e[len(b"data: "):] for e in events]
    assert payloads[-1] == b"[DONE]" and b"[DONE]" not in payloads[:-1]
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return text, payloads


def test_16_concurrent_streams_match_offline_api(server: Server,
                                                 offline_reference: dict[int, str]) -> None:
    async def main() -> list[str]:
        async with aiohttp.ClientSession() as session:
            bodies = [{"model": MODEL, "messages": messages(i), "max_tokens": MAX_TOKENS,
                       "stream": True, **({"temperature": 0} if i in GREEDY
                                          else {"temperature": 0.8, "seed": i})}
                      for i in range(len(TOPICS))]
            results = await asyncio.gather(*[_stream_chat(session, server.url, b) for b in bodies])
        return [text for text, _ in results]

    texts = asyncio.run(asyncio.wait_for(main(), 90))
    for i, text in enumerate(texts):
        # no broken characters
        assert isinstance(text, str) and text.strip() and "\ufffd" not in text, (i, text)
    mismatches = {i: (texts[i], offline_reference[i]) for i in GREEDY
                  if texts[i] != offline_reference[i]}
    assert not mismatches, f"streamed greedy text differs from the offline API: {mismatches}"


def test_disconnect_midway_aborts_and_frees_blocks(server: Server, engine_address: str) -> None:
    async def main() -> dict[str, float]:
        async with aiohttp.ClientSession() as session:
            body = {"messages": messages(3), "max_tokens": 2000, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            resp = await session.post(f"{server.url}/v1/chat/completions", json=body)
            assert resp.status == 200
            got = 0
            async for line in resp.content:
                got += line.startswith(b"data: ")
                if got >= 3:
                    break
            busy = await wait_engine_idle(engine_address, timeout=0)  # one look, mid-request
            assert busy["num_running"] + busy["num_waiting"] == 1
            assert busy["num_free_blocks"] < busy["num_blocks"]
            resp.close()  # the client goes away mid-stream
        return await wait_engine_idle(engine_address, timeout=15)

    stats = asyncio.run(asyncio.wait_for(main(), 60))
    assert is_idle(stats), stats
    assert stats["num_running"] == 0
    assert stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


LONG = "word " * 9000  # > the model's 8192-token context


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/chat/completions", b"{not json", None, "not valid JSON"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
     "model",
     "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
     "max_tokens",
     "max_tokens must be an integer in [1, "),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature",
     "temperature must be a number in [0, "),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, "prompt", "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages",
     "maximum context length"),
], ids=["invalid-json", "unknown-model", "negative-max-tokens", "negative-temperature",
        "prompt-too-long",
        "chat-too-long"])
def test_bad_input_is_400_and_server_keeps_serving(server: Server, engine_address: str, path: str,
                                                   body: Any, param: str | None,
                                                   needle: str) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            kw: dict[str, Any] = {"data": body, "headers": {"Content-Type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            async with session.post(server.url + path, **kw) as resp:
                assert resp.status == 400
                assert resp.headers["Content-Type"].startswith("application/json")
                err = (await resp.json())["error"]
            assert set(err) >= {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["param"] == param
            assert needle in err["message"], err["message"]
            ok = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                  "temperature": 0}
            async with session.post(f"{server.url}/v1/chat/completions", json=ok) as resp:
                assert resp.status == 200
                answer = await resp.json()
            assert answer["usage"]["completion_tokens"] >= 1
            assert answer["choices"][0]["message"]["content"]

    asyncio.run(asyncio.wait_for(main(), 60))


def test_server_log_has_no_errors(server: Server) -> None:
    """Runs last: nothing above (aborts, bad input, late outputs of aborted requests)
    logged an error."""
    log = server.log()
    bad = [line for line in log.splitlines() if "level=ERROR" in line or "Traceback" in line]
    assert not bad, "\n".join(bad)
