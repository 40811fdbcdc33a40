"""The router's choice, without engines: prefix affinity by rendezvous hashing, the overload escape,
dead replicas out of the ring."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from gateway.router import Router, RouterConfig, prefix_key, rendezvous
from shared.errors import EngineDead


@dataclass
class FakeClient:
    address: str
    connected: bool = True


def router(n: int = 3, **config: Any) -> Router:
    return Router([FakeClient(f"tcp://replica-{i}:5555") for i in range(n)],  # type: ignore[misc]
                  RouterConfig(affinity_tokens=32, **config))


def test_same_prefix_same_replica_and_unrelated_prompts_spread() -> None:
    r = router(imbalance_tokens=10**9)
    prefix = list(range(100, 132))
    homes = {r.route(prefix + [i, i + 1]).address for i in range(20)}
    assert len(homes) == 1  # only the first 32 tokens decide
    spread = {r.route([i] * 40).address for i in range(30)}
    assert spread == {x.address for x in r.replicas}


def test_choice_depends_only_on_prefix_and_addresses() -> None:
    """Every gateway process picks the same replica without talking to the others."""
    key = prefix_key(list(range(40)), 32)
    addresses = [f"tcp://replica-{i}:5555" for i in range(4)]
    assert rendezvous(key, addresses) == rendezvous(key, list(reversed(addresses)))
    assert key == prefix_key(list(range(32)) + [999], 32)


def test_removing_a_replica_moves_only_its_prefixes() -> None:
    addresses = [f"tcp://replica-{i}:5555" for i in range(4)]
    keys = [prefix_key([k] * 32, 32) for k in range(200)]
    before = {k: rendezvous(k, addresses) for k in keys}
    after = {k: rendezvous(k, addresses[1:]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != addresses[0])
    assert any(before[k] == addresses[0] for k in keys)


def test_overloaded_home_sends_the_request_to_the_least_loaded() -> None:
    r = router(n=2, imbalance_tokens=100)
    prompt = list(range(64))
    home = r.route(prompt)
    other = next(x for x in r.replicas if x is not home)
    home.queued_tokens = 500  # its STATS: a long queue
    assert r.route(prompt) is other
    home.queued_tokens, home.routed_tokens, other.routed_tokens = 0, 0, 0
    assert r.route(prompt) is home  # back home once the queue drains


def test_dead_replica_leaves_the_ring() -> None:
    r = router(n=2, imbalance_tokens=10**9)
    prompt = list(range(64))
    home = r.route(prompt)
    home.client.connected = False  # type: ignore[misc]
    assert r.route(prompt) is not home
    for x in r.replicas:
        x.client.connected = False  # type: ignore[misc]
    with pytest.raises(EngineDead):
        r.route(prompt)


def test_round_robin_ignores_prefixes() -> None:
    r = Router([FakeClient(f"tcp://replica-{i}:5555") for i in range(2)],  # type: ignore[misc]
               RouterConfig(policy="round_robin"))
    assert [r.route(list(range(64))).address
            for _ in range(4)] == [x.address for x in r.replicas] * 2
