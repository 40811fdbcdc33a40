"""The SDK's embed(): what the engine announced in READY is checked before anything is sent, and the
ADD carries the pooling request and the truncated tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared import protocol as P
from shared.client import AsyncEngineClient
from shared.embedding import PoolingInfo, PoolingParams
from shared.errors import ConveyorError, InvalidRequest
from tests.fakes import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_an_engine_that_announced_no_pooler_gets_no_embedding_request() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with AsyncEngineClient(eng.address) as client:
                with pytest.raises(
                    InvalidRequest, match="cannot compute embeddings: the engine did not announce"
                ):
                    await client.embed([1, 2, 3])
            assert eng.adds() == []

    run(main())


def test_embed_checks_then_sends_pooling_and_the_last_tokens() -> None:
    async def main() -> None:
        with FakeEngine(max_model_len=16) as eng:
            eng.ready.pooling = PoolingInfo("last", True, 8).to_dict()
            async with AsyncEngineClient(eng.address) as client:
                assert client.pooling == PoolingInfo("last", True, 8)
                cases: tuple[tuple[dict[str, Any], str], ...] = (
                    (dict(dimensions=4), "dimensions"),
                    (dict(truncate_prompt_tokens=17), "truncate_prompt_tokens"),
                    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                )
                for kw, param in cases:
                    with pytest.raises(InvalidRequest) as e:
                        await client.embed(list(range(20)), **kw)
                    assert e.value.param == param
                with pytest.raises(InvalidRequest, match="at most 16") as e:
                    await client.embed(list(range(20)))
                assert e.value.param == "input" and eng.adds() == []
                # The fake engine generates text instead of a vector: the SDK says so, never hangs.
                with pytest.raises(ConveyorError, match="ended without a vector"):
                    await client.embed(list(range(20)), dimensions=8, truncate_prompt_tokens=-1)
            add = eng.adds()[0]
            assert add.prompt_token_ids == list(range(4, 20)) and add.pooling == PoolingParams(8)
            assert isinstance(add, P.Add)

    run(main())
