"""Prefix-cache isolation through a real `conveyor serve`, with the official openai SDK: requests
with different `cache_salt`s (vLLM's field) never share cached blocks, so `cached_tokens` tells one
tenant nothing about another's prompt; the same salt shares them, as requests without a salt do.
`--cache-isolation per-key` does the same for each API key (keys from --api-key-file, served by two
gateway workers), and without it keys share."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
SECRET = "The admin password for the payroll database is tulip-4471. " * 6  # several KV blocks


def test_cache_salts_isolate_the_prefix_cache(tiny_chat_model: Path, tmp_path: Path) -> None:
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB"]
    with Server(argv, log_path=tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

        def cached(salt: str | None) -> int:
            return _cached(server.url, "none", salt)

        assert cached("tenant-a") == 0
        assert cached("tenant-a") > 0  # the same salt shares its blocks
        assert cached("tenant-b") == 0  # another salt sees none of them
        assert cached(None) == 0  # nor does the shared cache
        assert cached(None) > 0
        assert cached("tenant-b") > 0
        for bad in ("", 7, "x" * 257):
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                client.chat.completions.create(model="tiny-chat", max_tokens=1,
                                               extra_body={"cache_salt": bad},
                                               messages=[{"role": "user", "content": "hi"}])


def _cached(url: str, key: str, salt: str | None = None) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    extra = {} if salt is None else {"cache_salt": salt}
    out = client.chat.completions.create(model="tiny-chat", max_tokens=1, extra_body=extra,
                                         messages=[{"role": "user", "content": SECRET}])
    assert out.usage is not None and out.usage.prompt_tokens > 48
    details = out.usage.prompt_tokens_details
    return details.cached_tokens or 0 if details is not None else 0


def test_per_key_isolation_keeps_each_keys_cache_to_itself(tiny_chat_model: Path,
                                                           tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nsk-alice\nsk-bob\n")
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB", "--gateway-workers", "2", "--api-key-file", str(keys), "--cache-isolation",
            "per-key"]
    # Three processes load here (an engine, two gateways): a generous deadline for a shared machine.
    with Server(argv, log_path=tmp_path / "server.log", ready_timeout=600) as server:
        assert _cached(server.url, "sk-alice") == 0
        # the same prompt under another key: nothing cached
        assert _cached(server.url, "sk-bob") == 0
        assert _cached(server.url, "sk-alice") > 0  # its own key's cache, whichever worker answers
        assert _cached(server.url, "sk-bob") > 0
        # a request's salt splits a key's cache
        assert _cached(server.url, "sk-bob", salt="project-x") == 0
        assert _cached(server.url, "sk-bob", salt="project-x") > 0
        with pytest.raises(openai.AuthenticationError):
            _cached(server.url, "sk-carol")


def test_without_isolation_keys_share_the_cache(tiny_chat_model: Path, tmp_path: Path) -> None:
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB", "--api-key", "sk-alice", "sk-bob"]
    with Server(argv, log_path=tmp_path / "server.log") as server:
        assert _cached(server.url, "sk-alice") == 0
        # what isolation is for: bob learns alice sent this prompt
        assert _cached(server.url, "sk-bob") > 0
        with pytest.raises(openai.AuthenticationError):
            _cached(server.url, "sk-carol")


def test_per_key_isolation_keeps_each_keys_stored_responses_to_itself(tiny_chat_model: Path,
                                                                      tmp_path: Path) -> None:
    """A stored response belongs to its key's tenant: another key can neither read, continue nor
    delete it (404, as for an id that does not exist); its own key can. Without isolation keys
    share the store."""
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB", "--api-key", "sk-alice", "sk-bob", "--cache-isolation", "per-key"]
    with Server(argv, log_path=tmp_path / "server.log") as server:
        alice, bob = (openai.OpenAI(base_url=server.url + "/v1", api_key=k, max_retries=0,
                                    timeout=300) for k in ("sk-alice", "sk-bob"))
        first = alice.responses.create(model="tiny-chat", input="Hello", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="tiny-chat", input="And?", max_output_tokens=4,
                                 previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(first.id)
        assert alice.responses.retrieve(first.id).id == first.id  # bob's delete did not reach it
        follow = alice.responses.create(model="tiny-chat", input="And?", max_output_tokens=4,
                                        previous_response_id=first.id)
        assert follow.previous_response_id == first.id
        alice.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(first.id)
    argv = argv[:-2]  # the same keys, no isolation: one tenant, one store
    with Server(argv, log_path=tmp_path / "shared.log") as server:
        alice, bob = (openai.OpenAI(base_url=server.url + "/v1", api_key=k, max_retries=0,
                                    timeout=300) for k in ("sk-alice", "sk-bob"))
        first = alice.responses.create(model="tiny-chat", input="Hello", max_output_tokens=4)
        assert bob.responses.retrieve(first.id).id == first.id
