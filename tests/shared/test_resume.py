"""Requests that outlive their engine (shared/resume.py through the client): resubmitted as prompt +
the tokens delivered, with the budget left, under the same id; the stream goes on with nothing lost
or repeated. Against fake engines, so that every ADD the new engine receives can be checked."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared import protocol as P
from shared.client import AsyncEngineClient
from shared.errors import EngineDead
from shared.resume import resume_refusal
from shared.sampling import SamplingParams
from tests.fakes import FakeEngine

PROMPT = [5, 6, 7]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def continuing(add: P.Add) -> list[int]:
    """The fake model: token i of a sequence is 1000 + i, wherever the prompt ends; so a resumed
    request continues the very sequence it would have produced."""
    start = len(add.prompt_token_ids) - len(PROMPT)
    return [1000 + i for i in range(start, start + add.params.max_tokens)]


async def read_some(stream: Any, n: int) -> list[P.RequestOutput]:
    outs: list[P.RequestOutput] = []
    while sum(len(o.new_token_ids) for o in outs) < n:
        outs.append(await stream.__anext__())
    return outs


def test_a_request_resumes_on_a_restarted_engine_with_nothing_lost_or_repeated() -> None:
    params = SamplingParams(max_tokens=60, min_tokens=40, seed=7, temperature=0.8)

    async def main() -> None:
        eng = FakeEngine(script=continuing, step_interval=0.01).__enter__()
        async with AsyncEngineClient(eng.address, resume_timeout=10) as client:
            stream = await client.add(PROMPT, params, request_id="r1")
            outs = await read_some(stream, 5)
            eng.stop()  # the engine dies mid-decode
            with FakeEngine(script=continuing, address=eng.address) as new:
                outs += [o async for o in stream]
                add = new.adds()[0]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == [1000 + i for i in range(60)]  # each token once, in order
        d = len(add.prompt_token_ids) - len(PROMPT)
        assert d >= 5 and add.prompt_token_ids == PROMPT + tokens[:d] and add.request_id == "r1"
        assert (add.params.max_tokens, add.params.min_tokens) == (60 - d, 40 - d)
        assert (add.params.seed, add.params.temperature) == (7, 0.8)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        # never the resubmitted prompt
        assert all(o.num_prompt_tokens in (0, len(PROMPT)) for o in outs)
        assert outs[-1].num_prompt_tokens == len(PROMPT)
        assert outs[-1].events is not None and outs[-1].events["resumed"] == 1
    run(main())


def test_a_silent_engine_that_answers_again_drops_the_old_run_first() -> None:
    """The heartbeat's case: engine_lost() while the connection stays up. The held request is
    aborted on that engine before HELLO, so no row of the old run is delivered after the
    resubmission's."""
    async def main() -> None:
        with FakeEngine(script=continuing, step_interval=0.01) as eng:
            async with AsyncEngineClient(eng.address, resume_timeout=10) as client:
                stream = await client.add(PROMPT, SamplingParams(max_tokens=50), request_id="r1")
                outs = await read_some(stream, 3)
                client.engine_lost("no heartbeat for 5s")
                assert not client.connected
                outs += [o async for o in stream]
                assert eng.aborted == ["r1"] and len(eng.adds()) == 2
        assert [t for o in outs for t in o.new_token_ids] == [1000 + i for i in range(50)]
    run(main())


@pytest.mark.parametrize("params, why", [
    (SamplingParams(n=2), "n=2"),
    (SamplingParams(best_of=3), "best_of=3"),
    (SamplingParams(use_beam_search=True, beam_width=2), "beam search"),
    (SamplingParams(presence_penalty=0.5), "presence/frequency"),
    (SamplingParams(frequency_penalty=-0.5), "presence/frequency"),
])
def test_requests_that_cannot_resume_exactly_fail_at_once(params: SamplingParams, why: str) -> None:
    assert why in (resume_refusal(params) or "")

    async def main() -> None:
        eng = FakeEngine(tokens=list(range(1000)), step_interval=0.01).__enter__()
        async with AsyncEngineClient(eng.address, resume_timeout=60) as client:
            stream = await client.add(PROMPT,
                                      SamplingParams(**{**params.to_dict(), "max_tokens": 500}))
            await stream.__anext__()
            eng.stop()
            # long before the resume timeout
            with pytest.raises(EngineDead, match="cannot be resumed"):
                async for _ in stream:
                    pass
    run(main())


# logit_bias in its wire form, which SamplingParams.__post_init__ turns into the declared pairs
@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.3, logprobs=2,
                   logit_bias={3: 2.0}),  # type: ignore[arg-type]
    SamplingParams(temperature=0), SamplingParams(best_of=1, n=1)])
def test_resumable_params(params: SamplingParams) -> None:
    assert resume_refusal(params) is None


def test_prompt_logprobs_are_neither_sent_twice_nor_lost_on_resume() -> None:
    """They ride on a request's first row: delivered, the resubmission does not ask for them again
    (its prompt holds output tokens, which are no prompt to score); lost before any row, it asks
    again."""
    from shared.resume import InFlight

    add = P.Add("r1", PROMPT, SamplingParams(max_tokens=8, prompt_logprobs=2))
    early = InFlight(add, resume_refusal(add.params))
    again = early.resubmit()
    assert isinstance(again, P.Add) and again.prompt_token_ids == PROMPT
    assert again.params.prompt_logprobs == 2
    late = InFlight(add, resume_refusal(add.params))
    late.note(P.RequestOutput("r1", [1000], prompt_logprobs=[None, [-1.0, 1, []], [-2.0, 4, []]]))
    late.note(P.RequestOutput("r1", [1001]))
    again = late.resubmit()
    assert isinstance(again, P.Add) and again.prompt_token_ids == [*PROMPT, 1000, 1001]
    assert again.params.prompt_logprobs is None and again.params.max_tokens == 6


def test_every_ending_leaves_the_client_table_and_reaches_its_stream() -> None:
    """shared/requests.py: a refusal to resume, a held request's late row, a resume with nothing
    left to generate and the resume timeout each end through the one table; nothing is left in it
    after."""
    from shared.requests import RequestTable

    async def go() -> None:
        table = RequestTable()
        done = table.start(P.Add("done", PROMPT, SamplingParams(max_tokens=1)))
        going = table.start(P.Add("going", PROMPT, SamplingParams(max_tokens=4)))
        forked = table.start(P.Add("forked", PROMPT, SamplingParams(n=2, max_tokens=4)))
        for rid in ("done", "going"):
            table.deliver(P.RequestOutput(rid, [1000]), None)
        assert table.hold(True, "engine gone") == ["done", "going"]
        with pytest.raises(EngineDead, match="cannot be resumed.*n=2"):
            await forked.__anext__()
        table.deliver(P.RequestOutput("going", [1001]), None)  # the lost engine's: dropped
        adds = table.resume()
        assert [(a.request_id, a.prompt_token_ids, a.params.max_tokens) for a in adds] == \
            [("going", [*PROMPT, 1000], 3)]
        last = await done.__anext__()  # its row before the loss and its final one, merged (unread)
        assert (last.new_token_ids, last.finished, last.finish_reason) == ([1000], True, "length")
        assert (await going.__anext__()).new_token_ids == [1000]
        table.hold(True, "engine gone again")
        table.expire(EngineDead("did not come back"))
        with pytest.raises(EngineDead, match="did not come back"):
            await going.__anext__()
        assert len(table) == 0

    run(go())
