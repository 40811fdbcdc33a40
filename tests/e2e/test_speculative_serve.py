"""A real `conveyor serve --speculative ngram`: streams equal the plain engine's output,
the per-request opt-out works over HTTP, and /metrics reports proposals and acceptances as
they happen."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from gateway.metrics import parse
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import Server

pytestmark = pytest.mark.slow

# Repetitive text: prompt lookup finds its continuations (a random model repeats itself too).
PROMPTS = ["one two three four one two three four one two three", "a b c a b c a b", "Hello there"]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path):
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--speculative", "ngram", "--num-speculative-tokens",
                 "3"]) as srv:
        yield srv


def test_streams_equal_plain_output_and_metrics_move(server: Server, tiny_offline) -> None:
    expected = tiny_offline(PROMPTS, 40)

    async def main() -> tuple[list[str], str, dict, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.url}/metrics") as resp:
                before = parse(await resp.text())
            texts = await asyncio.gather(*(stream_completion(session, server.url, p, 40)
                                           for p in PROMPTS))
            body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    "speculative": False}
            async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                opted_out = (await resp.json())["choices"][0]["text"]
            async with session.get(f"{server.url}/metrics") as resp:
                after = parse(await resp.text())
            return texts, opted_out, before, after

    texts, opted_out, before, after = asyncio.run(asyncio.wait_for(main(), 120))
    assert texts == expected
    assert opted_out == expected[0]
    drafts = "conveyor_spec_decode_num_draft_tokens_total"
    accepted = "conveyor_spec_decode_num_accepted_tokens_total"
    assert after[drafts] > before.get(drafts, 0)
    assert after[accepted] > before.get(accepted, 0)
    assert 0 < after["conveyor_spec_decode_acceptance_rate"] <= 1
    assert after["conveyor_spec_decode_mean_accepted_length"] > 1
