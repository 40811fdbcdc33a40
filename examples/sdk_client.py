"""The Conveyor client SDK, end to end: talk to an engine over ZeroMQ without HTTP.

Start an engine (or a whole server) first, then point this at its address:
    python -m engine --address tcp://127.0.0.1:5555            # an engine alone
    python examples/sdk_client.py --engine-address tcp://127.0.0.1:5555
`conveyor serve` starts its engine on ipc:///tmp/conveyor-<gateway pid>.sock, an address that
works too.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.client import AsyncEngineClient
from shared.errors import EngineDead, InvalidRequest
from shared.sampling import SamplingParams
from shared.sync_client import EngineClient


async def async_examples(address: str, model: str | None) -> None:
    # model: where text calls load the tokenizer from; by default the model named in READY.
    async with AsyncEngineClient(address, name="sdk-example", model=model) as client:
        ready = client.ready
        print(f"connected: {ready.model_name}, context {ready.max_model_len} tokens")

        # 1. Token level: prompt ids in, deltas of token ids out.
        stream = await client.add([1, 2, 3, 4],
                                  SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        async for out in stream:
            print(f"  token delta {out.new_token_ids} finished={out.finished} "
                  f"reason={out.finish_reason}")

        # 2. Text level: the SDK tokenizes (a chat template for messages), detokenizes as it goes.
        params = SamplingParams(max_tokens=24, temperature=0)
        print("  text: ", end="", flush=True)
        async for out in client.stream_text([{"role": "user", "content": "Say hello."}], params):
            print(out.text, end="", flush=True)
        print(f"  [{out.finish_reason}, {out.num_prompt_tokens} prompt + {out.num_output_tokens} "
              "output tokens]")

        # 2b. Several choices (n): each TextOutput names its choice (`index`), generate_choices
        #     joins them.
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=1)
        for choice in await client.generate_choices("Once upon a time", params):
            tokens = [f"{e.token!r}:{e.logprob:.2f}" for e in choice.logprobs or []]
            print(f"  choice {choice.index}: {choice.text!r} ({choice.finish_reason}) "
                  f"{' '.join(tokens[:3])} ...")

        # 3. Abort: the stream ends with finish_reason "abort"; the engine frees the blocks.
        stream = await client.add([5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True),
                                  request_id="long-one")
        first = await stream.__anext__()
        await client.abort("long-one")  # idempotent: a second call does nothing
        rest = [out async for out in stream]
        print(f"  aborted after {len(first.new_token_ids)} token(s): {rest[-1].finish_reason}")

        # 4. Typed errors: a request the engine refuses raises InvalidRequest (the gateway's 400).
        try:
            too_long = [1] * (ready.max_model_len + 1)
            async for _ in await client.add(too_long, SamplingParams(max_tokens=1)):
                pass
        except InvalidRequest as e:
            print(f"  refused ({e.status}): {e}")
        print("  engine stats: "
              f"{ {k: v for k, v in (await client.get_stats()).items() if k.startswith('num_')} }")


def sync_example(address: str, model: str | None) -> None:
    # The blocking client runs the async one on a thread of its own: for scripts and notebooks.
    with EngineClient(address, name="sdk-example-sync", model=model) as client:
        out = client.generate_text("The capital of France is",
                                   SamplingParams(max_tokens=12, temperature=0))
        print(f"sync: {out.text!r} ({out.finish_reason})")
        for delta in client.stream_text("Once upon a time",
                                        SamplingParams(max_tokens=6, temperature=0)):
            print(f"  sync delta {delta.text!r}")


async def dead_engine() -> None:
    try:
        await AsyncEngineClient("tcp://127.0.0.1:9", ready_timeout=0.5).start()
    except EngineDead as e:
        print(f"no engine there ({e.status}): {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-address", default="tcp://127.0.0.1:5555")
    p.add_argument("--model", default=None,
                   help="the engine's model folder or .gguf, for the tokenizer; default: the "
                        "engine's model name (fine for the embedded default)")
    args = p.parse_args()
    asyncio.run(async_examples(args.engine_address, args.model))
    sync_example(args.engine_address, args.model)
    asyncio.run(dead_engine())


if __name__ == "__main__":
    main()
