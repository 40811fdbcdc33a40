"""`conveyor serve --gateway-workers 2`: two gateway processes on one port and one engine; streams
equal the offline API's output, connections land on both, both enforce the API key, /metrics sums
both, and SIGTERM stops all three; stored responses are one store for both."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.metrics import parse
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import Server, children, cmdline, tiny_serve

pytestmark = pytest.mark.slow


def test_two_workers_share_port_engine_and_metrics(
        tiny_chat_model: Path, tmp_path: Path,
        tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    prompts = [f"Worker test {i}:" for i in range(12)]
    expected = tiny_offline(prompts, 12)
    log = tmp_path / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--gateway-workers", "2",
                 "--num-threads", "1", "--kv-cache-memory", "32MiB", "--log-level", "info",
                 "--api-key", "sk-workers"], log_path=log) as srv:
        kids = {pid: cmdline(pid) for pid in children(srv.pid)}
        engines = [p for p, argv in kids.items() if argv[1:3] == ["-m", "engine"]]
        workers = [p for p, argv in kids.items() if argv[1:4] == ["-m", "gateway", "gateway"]]
        assert len(engines) == 1 and len(workers) == 1, kids
        assert "--reuse-port" in kids[workers[0]] and srv.engine_address in kids[workers[0]]

        async def main() -> tuple[list[str], list[dict[str, float]]]:
            # one connection per request: the kernel spreads them
            connector = aiohttp.TCPConnector(force_close=True)
            # --api-key reaches the worker too (by environment)
            auth = {"Authorization": "Bearer sk-workers"}
            async with aiohttp.ClientSession(connector=connector, headers=auth) as session:
                # The workers serve first and the parent binds the port last: wait until
                # both answered.
                for _ in range(200):
                    if len(set(re.findall(r"pid=(\d+) msg=.*GET /ready", log.read_text()))) == 2:
                        break
                    async with session.get(f"{srv.url}/ready"):
                        await asyncio.sleep(0.02)
                texts = await asyncio.gather(*[stream_completion(session, srv.url, p, 12)
                                               for p in prompts])
                fresh = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=fresh) as anon:
                    for _ in range(4):
                        async with anon.get(f"{srv.url}/v1/models") as resp:
                            assert resp.status == 401
                scrapes = []
                for _ in range(6):
                    async with session.get(f"{srv.url}/metrics") as resp:
                        scrapes.append(parse(await resp.text()))
            return texts, scrapes

        texts, scrapes = asyncio.run(asyncio.wait_for(main(), 120))
        assert texts == expected
        served_by = set(re.findall(r"pid=(\d+) msg=.*POST /v1/completions", log.read_text()))
        assert served_by == {str(srv.pid), str(workers[0])}, served_by
        for m in scrapes:  # whichever worker answers the scrape, it reports the sum over both
            assert m["conveyor_requests_total{finish_reason=length}"] == len(prompts)
            assert m["conveyor_generation_tokens_total"] == 12 * len(prompts)
            assert m["conveyor_time_to_first_token_seconds_count"] == len(prompts)
            assert m["conveyor_engine_up"] == 1
    assert srv.proc is not None and srv.proc.returncode == 0


def test_chained_responses_reach_whichever_worker(tiny_chat_model: Path, tmp_path: Path) -> None:
    """A conversation chained with previous_response_id through the official openai SDK, one
    connection per request so that the kernel spreads them over both workers: every turn continues
    the whole history (its prompt is the template's rendering of every earlier turn, counted by
    transformers), and GET, input_items and DELETE answer the same whichever worker stored the
    response. The workers' shared store lives in a folder of the serve's, gone once it stops."""
    import httpx2
    import openai

    from tests.fakes import smollm2_tokenizer

    tok = smollm2_tokenizer()
    log = tmp_path / "server.log"
    with Server(tiny_serve(tiny_chat_model, "--gateway-workers", "2", "--log-level", "info",
                           "--dtype", "float32"), log_path=log) as srv:
        worker = next(p for p in children(srv.pid)
                      if cmdline(p)[1:4] == ["-m", "gateway", "gateway"])
        argv = cmdline(worker)
        store = Path(argv[argv.index("--responses-store-path") + 1])
        assert store.exists()
        # a connection per call
        fresh = openai.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60,
                               http_client=fresh)
        history: list[dict[str, str]] = []
        chain: list[Any] = []

        def served_by(route: str) -> set[str]:
            return set(re.findall(rf"pid=(\d+) msg=.*{route}", log.read_text()))

        # Until both workers served some turns (at least 8): a turn served by the one that did
        # not store the turn before it is then certain. Each process writes its access-log line
        # as it answers.
        while len(chain) < 8 or len(served_by("POST /v1/responses")) < 2:
            assert len(chain) < 40, served_by("POST /v1/responses")
            ask = {"role": "user", "content": f"Turn {len(chain)}: say a word."}
            r = client.responses.create(model="tiny-chat", input=ask["content"],
                                        max_output_tokens=4, temperature=0,
                                        previous_response_id=chain[-1].id if chain else None)
            history += [ask]
            prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
            assert r.usage is not None
            assert r.usage.input_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
            history += [{"role": "assistant", "content": r.output_text}]
            chain.append(r)
        assert served_by("POST /v1/responses") == {str(srv.pid), str(worker)}
        for r in chain:  # whichever worker answers
            assert client.responses.retrieve(r.id).output_text == r.output_text
            items = client.responses.input_items.list(r.id)
            assert [i.model_dump()["content"][0]["text"]
                    for i in items.data] == [f"Turn {chain.index(r)}: say a word."]
        for r in chain[::2]:
            client.responses.delete(r.id)
        for r in chain:
            if chain.index(r) % 2 == 0:
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(r.id)
            else:
                assert client.responses.retrieve(r.id).id == r.id
        assert len(served_by("GET /v1/responses/")) == 2
        fresh.close()
    assert srv.proc is not None and srv.proc.returncode == 0
    assert not store.parent.exists()
