"""The client SDK against a fake engine: streaming, abort, typed errors, handshake timeout, engine
loss."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shared import protocol as P
from shared.client import AsyncEngineClient
from shared.errors import EngineDead, InvalidRequest
from shared.sampling import SamplingParams
from shared.sync_client import EngineClient
from shared.tokenizer import apply_chat_template
from tests.fakes import FakeEngine, fake_logprobs, smollm2_tokenizer


def run(coro):  # tiny helper, no pytest-asyncio needed
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_handshake_reports_engine_facts() -> None:
    async def main() -> None:
        with FakeEngine(max_model_len=123) as eng:
            async with AsyncEngineClient(eng.address) as client:
                assert client.ready is not None
                assert (client.ready.model_name,
                        client.ready.max_model_len) == ("SmolLM2-135M-Instruct", 123)
    run(main())


def test_streams_deltas_until_finished() -> None:
    async def main() -> None:
        with FakeEngine(tokens=[5, 6, 7, 8, 9], tokens_per_step=2) as eng:
            async with AsyncEngineClient(eng.address) as client:
                stream = await client.add([1, 2, 3], SamplingParams(max_tokens=10), request_id="r1")
                outs = [o async for o in stream]
        # Deltas that arrive while the consumer is busy are merged, so only the joined tokens are
        # fixed.
        assert [t for o in outs for t in o.new_token_ids] == [5, 6, 7, 8, 9]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "stop" and outs[-1].num_prompt_tokens == 3
        assert eng.adds()[0].prompt_token_ids == [1, 2, 3]
    run(main())


def test_many_requests_are_routed_to_their_own_streams() -> None:
    async def main() -> None:
        script = lambda add: [add.prompt_token_ids[0]] * 4  # noqa: E731 - each request echoes its id
        with FakeEngine(script=script) as eng:
            async with AsyncEngineClient(eng.address) as client:
                streams = [await client.add([i + 10], SamplingParams(max_tokens=8))
                           for i in range(20)]
                results = await asyncio.gather(*[_collect(s) for s in streams])
        assert results == [[i + 10] * 4 for i in range(20)]
    run(main())


async def _collect(stream) -> list[int]:
    return [t async for o in stream for t in o.new_token_ids]


def test_max_tokens_gives_length() -> None:
    async def main() -> None:
        with FakeEngine(tokens=list(range(100, 150))) as eng:
            async with AsyncEngineClient(eng.address) as client:
                outs = [o async for o in await client.add([1], SamplingParams(max_tokens=4))]
        assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
    run(main())


def test_abort_ends_stream_and_reaches_engine_and_is_idempotent() -> None:
    async def main() -> None:
        with FakeEngine(tokens=list(range(1000)), step_interval=0.01) as eng:
            async with AsyncEngineClient(eng.address) as client:
                stream = await client.add([1], SamplingParams(max_tokens=1000), request_id="long")
                first = await stream.__anext__()
                await client.abort("long")
                await client.abort("long")
                await client.abort("never-existed")
                rest = [o async for o in stream]
                assert eng.wait_for(lambda: "long" in eng.aborted)
        assert first.new_token_ids == [0]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert eng.aborted == ["long"]  # the second abort was a no-op on the client side
    run(main())


def test_reset_prefix_cache_reaches_the_engine() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with AsyncEngineClient(eng.address) as client:
                await client.reset_prefix_cache()
                assert eng.wait_for(lambda: any(isinstance(m, P.ResetPrefixCache)
                                                for m in eng.received))
    run(main())


def test_engine_error_raises_invalid_request() -> None:
    async def main() -> None:
        reject = lambda add: "prompt is too long" if len(add.prompt_token_ids) > 2 else None  # noqa: E731
        with FakeEngine(reject=reject) as eng:
            async with AsyncEngineClient(eng.address) as client:
                stream = await client.add([1, 2, 3], SamplingParams())
                with pytest.raises(InvalidRequest, match="too long"):
                    await stream.__anext__()
                # the client still works
                ok = [o async for o in await client.add([1], SamplingParams())]
                assert ok[-1].finished
    run(main())


def test_no_ready_gives_engine_dead_within_timeout() -> None:
    async def main() -> None:
        # engine mute, or nothing listening at all
        for eng in (FakeEngine(answer_hello=False), None):
            address = eng.address if eng else "tcp://127.0.0.1:9"
            client = AsyncEngineClient(address, ready_timeout=0.3)
            start = time.monotonic()
            with pytest.raises(EngineDead, match="did not answer HELLO"):
                await client.start()
            assert time.monotonic() - start < 2
            await client.close()
            if eng:
                eng.stop()
    run(main())


def test_engine_loss_fails_inflight_requests_after_resume_timeout_then_reconnects() -> None:
    async def main() -> None:
        eng = FakeEngine(tokens=list(range(1000)), step_interval=0.01).__enter__()
        async with AsyncEngineClient(eng.address, ready_timeout=3, resume_timeout=0.3) as client:
            stream = await client.add([1], SamplingParams(max_tokens=1000))
            await stream.__anext__()
            eng.stop()
            with pytest.raises(EngineDead, match="did not come back within 0.3s"):
                async for _ in stream:
                    pass
            # the engine comes back on the same address
            with FakeEngine(tokens=[7], address=eng.address):
                outs = [o async for o in await client.add([1], SamplingParams())]
                assert outs[-1].new_token_ids == [7]
    run(main())


def test_get_stats_and_closed_client() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            client = AsyncEngineClient(eng.address)
            await client.start()
            assert await client.get_stats() == {"num_running": 0.0}
            await client.close()
            await client.close()
            with pytest.raises(EngineDead):
                await client.add([1], SamplingParams())
    run(main())


def test_duplicate_request_id_is_rejected() -> None:
    async def main() -> None:
        with FakeEngine(tokens=list(range(100)), step_interval=0.05) as eng:
            async with AsyncEngineClient(eng.address) as client:
                await client.add([1], SamplingParams(max_tokens=50), request_id="same")
                with pytest.raises(InvalidRequest, match="already running"):
                    await client.add([1], SamplingParams(), request_id="same")
    run(main())


def test_text_level_generate_with_stop_string_aborts_engine() -> None:
    tok = smollm2_tokenizer()
    ids = tok.encode("The capital of France is Paris. It is big.")

    async def main() -> None:
        with FakeEngine(tokens=ids, step_interval=0.01) as eng:
            async with AsyncEngineClient(eng.address, tokenizer=tok) as client:
                out = await client.generate_text("Capital?",
                                                 SamplingParams(max_tokens=100, stop=("Paris",)))
                assert out.text == "The capital of France is " and out.finish_reason == "stop"
                assert eng.wait_for(lambda: eng.aborted == [out.request_id])
                chat = await client.generate_text([{"role": "user", "content": "hi"}],
                                                  SamplingParams(max_tokens=100))
                assert chat.text == "The capital of France is Paris. It is big."
                assert chat.finish_reason == "stop"
                hi = [{"role": "user", "content": "hi"}]
                assert eng.adds()[-1].prompt_token_ids == apply_chat_template(tok, hi)
                assert chat.num_prompt_tokens == len(eng.adds()[-1].prompt_token_ids)
    run(main())


def test_sync_client() -> None:
    with FakeEngine(tokens=[4, 5, 6]) as eng, EngineClient(eng.address) as client:
        assert client.ready.model_name == "SmolLM2-135M-Instruct"
        outs = list(client.add([1, 2], SamplingParams(max_tokens=8)))
        assert [t for o in outs for t in o.new_token_ids] == [4, 5, 6] and outs[-1].finished
        assert client.get_stats()["num_running"] == 0.0
        stream = client.add([1], SamplingParams(max_tokens=8), request_id="x")
        next(stream)
        client.abort("x")
        assert list(stream)[-1].finish_reason in ("abort", "stop")


def test_sync_client_text_calls() -> None:
    tok = smollm2_tokenizer()
    with (FakeEngine(tokens=tok.encode("Bonjour 你好")) as eng,
          EngineClient(eng.address, tokenizer=tok) as client):
        parts = list(client.stream_text("Say hi", SamplingParams(max_tokens=20)))
        assert "".join(p.text for p in parts) == "Bonjour 你好"
        assert parts[-1].finish_reason == "stop"
        cut = client.generate_text("Say hi", SamplingParams(max_tokens=20, stop=("你",)))
        assert cut.text == "Bonjour "


def test_slow_consumer_gets_merged_deltas_not_a_queue() -> None:
    """A consumer that does not read for a while finds one merged delta, not one queued per step."""
    async def main() -> None:
        with FakeEngine(tokens=list(range(10, 40)), step_interval=0.005) as eng:
            seen: list[int] = []
            async with AsyncEngineClient(eng.address) as client:
                client.on_output = lambda out: seen.append(len(out.new_token_ids))
                stream = await client.add([1], SamplingParams(max_tokens=30))
                first = await stream.__anext__()
                await asyncio.sleep(0.6)  # the engine finishes meanwhile
                rest = [o async for o in stream]
        # On a busy machine the first read may already find two steps merged; either way the rest
        # of the request comes as one delta, in order, with nothing lost or repeated.
        assert 1 <= len(first.new_token_ids) < 30 and not first.finished
        assert len(rest) == 1 and rest[0].finished and rest[0].finish_reason == "length"
        assert first.new_token_ids + rest[0].new_token_ids == list(range(10, 40))
        assert seen == [1] * 30  # the on_output hook still saw every engine step
    run(main())


def test_text_calls_with_n_choices_stop_strings_and_logprobs() -> None:
    """One detokenizer per choice: each TextOutput belongs to one `index`, a stop string ends its
    own choice, and logprobs come with the text they make up."""
    tok = smollm2_tokenizer()
    texts = ["The capital of France is Paris.", "Once upon a time there was a cat"]
    choices = [tok.encode(t) for t in texts]

    async def main() -> None:
        with FakeEngine(choices=lambda add: choices) as eng:
            async with AsyncEngineClient(eng.address, tokenizer=tok) as client:
                params = SamplingParams(max_tokens=50, n=2, stop=("Paris",), logprobs=1)
                outs = [o async for o in client.stream_text("hi", params)]
                whole = await client.generate_choices("hi", params)
                with pytest.raises(InvalidRequest, match="generate_choices"):
                    await client.generate_text("hi", params)
        assert {o.index for o in outs} == {0, 1}
        assert outs[-1].finished
        assert not any(o.finished for o in outs[:-1])
        assert [o.finish_reason for o in outs if o.finish_reason] == ["stop", "stop"]
        # choice 0 counts up to its stop string
        assert outs[-1].num_output_tokens == len(choices[1]) + 6
        assert [(w.index, w.text, w.finish_reason)
                for w in whole] == [(0, "The capital of France is ", "stop"), (1, texts[1], "stop")]
        first, second = [w.logprobs for w in whole]
        assert first is not None and second is not None  # both asked for logprobs
        assert [e.token for e in first] == ["The", " capital", " of", " France", " is"]
        assert [e.token_id for e in second] == choices[1]
        assert [e.logprob for e in second] == [fake_logprobs(t, i, 1)[0]
                                               for i, t in enumerate(choices[1])]
        assert all(e.top == [(e.token_id, e.token, e.logprob)] for w in (first, second) for e in w)
    run(main())


def test_sync_client_generate_choices() -> None:
    tok = smollm2_tokenizer()
    with FakeEngine(choices=lambda add: [tok.encode(" a b"), tok.encode(" c")]) as eng, \
            EngineClient(eng.address, tokenizer=tok) as client:
        outs = client.generate_choices("hi", SamplingParams(max_tokens=20, n=2))
        assert [(o.index, o.text, o.logprobs) for o in outs] == [(0, " a b", None), (1, " c", None)]
        assert outs[0].num_output_tokens == 3


_CLOSE_WHILE_ENGINE_GOES = """
import asyncio, threading
import shared.client as C
from tests.fakes import FakeEngine

async def main():
    eng = FakeEngine().__enter__()
    client = C.AsyncEngineClient(eng.address)
    monitor_loop = client._monitor_loop

    async def engine_goes_as_the_monitor_closes(monitor):
        try:
            await monitor_loop(monitor)
        finally:
            # the monitor's PAIR is closed now; the engine's socket closes; let the I/O thread
            # see it
            eng.stop()
            threading.Event().wait(0.2)

    client._monitor_loop = engine_goes_as_the_monitor_closes
    await client.start(10)
    await client.close()

for _ in range(3):
    asyncio.run(main())
print("closed")
"""


def test_close_returns_when_the_engine_goes_away_during_it() -> None:
    """libzmq blocks its I/O thread for good on a monitor event for a closed PAIR (libzmq#3575), and
    the client's close() with it, holding the GIL: a gateway or test whose engine died as it shut
    down hung. In a subprocess, so a hang fails this test instead of stopping the suite."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CLOSE_WHILE_ENGINE_GOES], capture_output=True,
                          text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]
