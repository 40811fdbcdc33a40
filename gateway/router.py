"""Data parallelism: one gateway in front of several engine replicas, each request on one of them.

Routing, per request:
1. Prefix affinity: the prompt's first `affinity_tokens` tokens are hashed, and rendezvous hashing
   (highest hash of (prefix, replica address)) picks a live replica. Requests that share a system
   prompt or a document land where its KV blocks are cached; a replica leaving or joining moves only
   its own share of prefixes, and every gateway (several processes, several hosts) picks the same
   replica without talking to the others, because the score depends only on the prefix and the
   addresses.
2. Unless that replica is overloaded: its queued tokens (waiting prompts' tokens from its last
   STATS, plus the prompt tokens routed to it since) exceed the least loaded replica's by more than
   `imbalance_tokens`; then the least loaded one takes it (a cache miss costs less than the queue).
A request stays on its replica: its stream, its aborts, its n > 1 choices and stop strings all go
through that replica's client (AsyncEngineClient.stream_text). A replica whose engine is gone is not
connected, so it is out of the ring; its resumable requests move at once to a live replica and
resume there (prompt + delivered tokens, shared/resume.py), the others end with an error, as with
one engine.

Router offers what the gateway uses of AsyncEngineClient, so routes, streaming and WebSockets are
the same for one engine and for N.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from shared.choices import TextOutput
from shared.client import AsyncEngineClient
from shared.embedding import EmbeddingOutput, PoolingInfo
from shared.errors import ConveyorError, EngineDead, InvalidRequest
from shared.protocol import Ready, RequestOutput
from shared.sampling import SamplingParams
from shared.tokenizer import Prompt, is_token_ids

log = logging.getLogger(__name__)
ROUTING_POLICIES = ("prefix", "round_robin")
JOIN_RETRY_S = 30.0  # a replica not up yet is waited for in rounds of this long (a log line each)


@dataclass(frozen=True)
class RouterConfig:
    affinity_tokens: int = 32  # the prefix that decides a request's replica (two blocks of 16)
    # queued tokens above the least loaded replica's that count as overloaded
    imbalance_tokens: int = 2048
    stats_interval: float = 0.5  # how often each replica's STATS are polled for its queue
    # prefix: affinity as above; round_robin: each live replica in turn (the baseline
    # bench/scale_out.py measures affinity against: fewer prefix-cache hits, the same balance).
    policy: str = "prefix"

    def __post_init__(self) -> None:
        if self.affinity_tokens < 1 or self.imbalance_tokens < 0 or self.stats_interval <= 0:
            raise ValueError("affinity_tokens must be >= 1, imbalance_tokens >= 0, stats_interval "
                             "> 0")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")


def prefix_key(token_ids: list[int], affinity_tokens: int) -> bytes:
    """A stable digest of the prompt's first tokens (the same in every process, unlike hash())."""
    head = token_ids[:affinity_tokens]
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in head), digest_size=16).digest()


def rendezvous(key: bytes, addresses: list[str]) -> str:
    """The address with the highest score for key: highest random weight hashing."""
    return max(addresses, key=lambda a: hashlib.blake2b(key + a.encode(), digest_size=8).digest())


class Replica:
    """One engine replica as the router sees it: its client, its load, what was routed to it."""

    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self.address = client.address
        self.queued_tokens = 0.0  # from its last STATS
        self.routed_tokens = 0  # prompt tokens routed to it since that STATS
        self.num_routed = 0  # requests routed to it, ever
        self.stats: dict[str, float] | None = None
        self.refused: str | None = None  # why it is kept out of the ring for good (another model)
        self.joiner: asyncio.Task[None] | None = None  # waits for its first handshake

    @property
    def load(self) -> float:
        return self.queued_tokens + self.routed_tokens

    @property
    def live(self) -> bool:
        """In the ring: its engine answered the handshake and has not been lost since (the socket,
        the heartbeat or a supervisor says so at once)."""
        return self.client.connected and self.refused is None


class Router:
    def __init__(self, clients: list[AsyncEngineClient],
                 config: RouterConfig | None = None) -> None:
        if not clients:
            raise ValueError("a router needs at least one engine")
        self.replicas = [Replica(c) for c in clients]
        for c in clients:
            c.on_held = functools.partial(self._move_held, c)
        self.config = config or RouterConfig()
        self.address = ",".join(r.address for r in self.replicas)
        self.ready: Ready | None = None
        self._first = asyncio.Event()  # some replica answered the handshake
        self._tokenizer: Any = None
        self._poller: asyncio.Task[None] | None = None

    # -- what the gateway uses of AsyncEngineClient ------------------------------------------------
    @property
    def connected(self) -> bool:
        return any(r.live for r in self.replicas)

    @property
    def on_output(self) -> Callable[[RequestOutput], None] | None:
        return self.replicas[0].client.on_output

    @on_output.setter
    def on_output(self, fn: Callable[[RequestOutput], None] | None) -> None:
        for r in self.replicas:
            r.client.on_output = fn

    async def start(self, timeout: float | None = None) -> Ready:
        """Returns once any replica answered the handshake (EngineDead when none did within
        timeout). The others join the ring whenever they first answer, and any replica lost later
        rejoins when it comes back: the gateway starts with whichever replicas are up, and never
        needs a restart for them."""
        for r in self.replicas:
            if r.joiner is None:
                r.joiner = asyncio.create_task(self._join(r))
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_stats())
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
        except TimeoutError:
            raise EngineDead(f"no engine replica answered HELLO within {timeout:g}s "
                             f"({self.address})") from None
        assert self.ready is not None
        return self.ready

    async def _join(self, r: Replica) -> None:
        """Waits for this replica's first READY (its client greets it again by itself after
        each loss); one serving another model than the first replica's is kept out of the
        ring, with a log line."""
        while True:
            try:
                ready = await r.client.start(timeout=JOIN_RETRY_S)
                break
            except EngineDead as e:
                log.info("replica %s not up yet: %s", r.address, e)
                await asyncio.sleep(1.0)  # a client dead for good answers at once: do not spin
        if self.ready is None:
            self.ready = ready
        elif (ready.model_name, ready.max_model_len) != (self.ready.model_name,
                                                         self.ready.max_model_len):
            r.refused = (f"it serves {ready.model_name} (max_model_len {ready.max_model_len}), the "
                         "others "
                         f"{self.ready.model_name} ({self.ready.max_model_len})")
            log.error("replica_refused replica=%s why=%s", r.address, r.refused)
            return
        log.warning("replica_joined replica=%s live=%d/%d", r.address,
                    sum(x.live for x in self.replicas), len(self.replicas))
        self._first.set()

    async def close(self) -> None:
        tasks = [t for t in (self._poller, *(r.joiner for r in self.replicas)) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._poller = None
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    async def get_tokenizer(self) -> Any:
        """Loaded once and given to every replica's client: from the gateway's --model when given,
        else from the model of the first replica that answered."""
        await self._first.wait()
        loader = next(r.client for r in self.replicas if r.client.ready is not None)
        tok = self._tokenizer = await loader.get_tokenizer()
        for r in self.replicas:
            r.client.use_tokenizer(tok)
        return tok

    async def get_stats(self, timeout: float = 5.0) -> dict[str, float]:
        """The live replicas' STATS summed (usage fractions averaged): the gateway's one-engine
        view."""
        stats = [s for s in await self.replica_stats(timeout) if s is not None]
        if not stats:
            raise EngineDead(f"no engine replica answered GET_STATS within {timeout:g}s")
        total = {k: sum(s.get(k, 0.0) for s in stats) for k in stats[0]}
        for k in total:
            if k.endswith("usage") or k.endswith("_rate") or k.startswith("spec_mean"):
                total[k] /= len(stats)
        return total

    async def replica_stats(self, timeout: float = 5.0) -> list[dict[str, float] | None]:
        """Each replica's fresh STATS, in replica order; None for one that did not answer."""
        async def one(r: Replica) -> dict[str, float] | None:
            if not r.live:
                return None
            with contextlib.suppress(ConveyorError):
                r.stats = await r.client.get_stats(timeout=timeout)
                return r.stats
            return None
        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    async def reset_prefix_cache(self) -> None:
        await asyncio.gather(*(r.client.reset_prefix_cache() for r in self.replicas if r.live))

    async def stream_text(self, prompt: Prompt, params: SamplingParams,
                          request_id: str | None = None,
                          priority: int = 0) -> AsyncGenerator[TextOutput, None]:
        """AsyncEngineClient.stream_text on the replica route() picks; everything about the request
        (aborts, stop strings of its choices) goes to that replica."""
        if self._tokenizer is None and not is_token_ids(prompt):
            await self.get_tokenizer()
        ids = await self.replicas[0].client.encode_prompt(prompt)
        replica = self.route(ids)
        async for out in replica.client.stream_text(ids, params, request_id, priority):
            yield out

    @property
    def pooling(self) -> PoolingInfo:
        return self.replicas[0].client.pooling

    async def embed(self, prompt: Prompt, dimensions: int | None = None,
                    truncate_prompt_tokens: int | None = None, request_id: str | None = None,
                    priority: int = 0) -> EmbeddingOutput:
        """AsyncEngineClient.embed on the replica route() picks."""
        ids = await self.replicas[0].client.encode_prompt(prompt)
        client = self.route(ids).client
        return await client.embed(ids, dimensions, truncate_prompt_tokens, request_id, priority)

    # -- routing -----------------------------------------------------------------------------------
    def route(self, token_ids: list[int]) -> Replica:
        """The prefix's replica unless it is overloaded, then the least loaded. Counts the request
        there."""
        live = [r for r in self.replicas if r.live]
        if not live:
            raise EngineDead(f"no engine replica is connected ({self.address})")
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if self.config.policy == "round_robin":
            chosen = min(live, key=lambda r: r.num_routed)
            chosen.num_routed += 1
            return chosen
        by_address = {r.address: r for r in live}
        chosen = by_address[rendezvous(prefix_key(token_ids, self.config.affinity_tokens),
                                       list(by_address))]
        least = min(live, key=lambda r: (r.load, r.num_routed))
        if chosen.load > least.load + self.config.imbalance_tokens:
            log.debug("replica %s overloaded (%.0f queued tokens vs %.0f): request to %s",
                      chosen.address, chosen.load, least.load, least.address)
            chosen = least
        chosen.routed_tokens += len(token_ids)
        chosen.num_routed += 1
        return chosen

    # -- a replica lost -------------------------------------------------------------------------
    def _move_held(self, lost: AsyncEngineClient) -> None:
        """A replica's engine is lost with requests held for resuming: resume each on a live replica
        now (prompt + delivered tokens, shared/resume.py), routed as a new request would be. With no
        replica live they wait for whichever comes back first (the stats poller retries)."""
        if not any(r.live for r in self.replicas if r.client is not lost):
            return
        moved = lost.hand_over()
        for rec in moved:
            target = self.route(rec.prompt_token_ids)
            if not target.client.adopt(rec):
                rec.stream.put(EngineDead(f"the engine at {lost.address} was lost and request "
                                          f"{rec.request_id!r} could not move to "
                                          f"{target.address}: retry it"))
        if moved:
            log.warning("replica %s lost: %d request(s) resumed on the live replicas", lost.address,
                        len(moved))

    async def _poll_stats(self) -> None:
        """Each replica's queue, fresh every stats_interval; the tokens routed since then
        are counted on top until the next answer includes them. Requests held for a lost
        replica move to a live one."""
        while True:
            await asyncio.sleep(self.config.stats_interval)
            for r in self.replicas:
                if not r.client.connected and r.client.has_held:
                    self._move_held(r.client)
            for r, stats in zip(self.replicas,
                                await self.replica_stats(timeout=self.config.stats_interval * 4)):
                if stats is not None:
                    r.queued_tokens, r.routed_tokens = float(stats.get("num_queued_tokens", 0.0)), 0
