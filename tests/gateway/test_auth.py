"""Several API keys and --cache-isolation per-key against a fake engine: which keys are let in, by
which header, and the cache_salt every door (chat, completions, both WebSockets, Responses,
Messages) sends the engine. The flags' parsing: repeated and multi-value --api-key,
CONVEYOR_API_KEY, --api-key-file. That the salt really isolates the cache in a real engine:
tests/e2e/test_cache_salt.py."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.auth import Auth, auth_of, worker_env
from tests.fakes import FakeEngine
from tests.gateway.test_routes import MODEL, gateway, run

KEYS = ("sk-alice", "sk-bob")
ALICE = {"Authorization": "Bearer sk-alice"}
DONE = ("response.completed", "response.incomplete")  # the Responses WebSocket's last event


def test_each_key_is_let_in_by_either_header_and_no_other() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, auth=Auth(KEYS)) as http:
                body = {"prompt": "hi", "max_tokens": 2}
                for headers in ({"Authorization": "Bearer sk-alice"},
                                {"Authorization": "bearer sk-bob"}, {"x-api-key": "sk-bob"}):
                    assert (await http.post("/v1/completions", json=body,
                                            headers=headers)).status == 200
                for headers in ({}, {"Authorization": "Bearer sk-carol"},
                                {"Authorization": "Bearer sk-alic"}, {"Authorization": "sk-alice"},
                                {"Authorization": "Bearer sk-alice sk-bob"},
                                {"x-api-key": "sk-alice2"}):
                    resp = await http.post("/v1/completions", json=body, headers=headers)
                    assert resp.status == 401, headers
                    assert (await resp.json())["error"]["type"] == "authentication_error"
    run(main())


async def _salts_of_every_door(http: Any, eng: FakeEngine,
                               headers: dict[str, str]) -> list[str | None]:
    """The cache_salt of one request through each door, in this order: chat, completions (a batch of
    two), chat with its own cache_salt, /v1/ws, /v1/responses, /v1/messages, the Responses
    WebSocket."""
    before = len(eng.adds())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
                       ("/v1/chat/completions", {**chat, "cache_salt": "team-1"}),):
        assert (await http.post(path, json=body, headers=headers)).status == 200, path
    ws = await http.ws_connect("/v1/ws", headers=headers)
    await ws.send_json({"op": "chat.completions", "id": "a", "body": chat})
    while (frame := await asyncio.wait_for(ws.receive_json(), 10))["event"] != "done":
        assert frame["event"] == "chunk", frame
    await ws.close()
    resp = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                           headers=headers)
    assert resp.status == 200, await resp.text()
    resp = await http.post("/v1/messages", json={"model": MODEL, **chat}, headers=headers)
    assert resp.status == 200, await resp.text()
    ws = await http.ws_connect("/v1/responses", headers=headers)
    await ws.send_json({"type": "response.create", "input": "hi", "max_output_tokens": 2})
    while (frame := await asyncio.wait_for(ws.receive_json(), 10))["type"] not in DONE:
        assert frame["type"] != "error", frame
    await ws.close()
    assert eng.wait_for(lambda: len(eng.adds()) == before + 8)
    return [add.params.cache_salt for add in eng.adds()[before:]]


def test_per_key_isolation_salts_every_door_with_the_key_and_never_sends_it() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, auth=Auth(KEYS, "per-key")) as http:
                alice = await _salts_of_every_door(http, eng, ALICE)
                bob = await _salts_of_every_door(http, eng, {"x-api-key": "sk-bob"})
                again = await _salts_of_every_door(http, eng, ALICE)
        own = 3  # the chat request with its own cache_salt
        for salts in (alice, bob):
            # the request's salt is mixed in
            assert salts[own] is not None and salts[own] != salts[0]
            # one tenant salt elsewhere
            assert len({s for i, s in enumerate(salts) if i != own}) == 1
            assert all(s is not None and "sk-" not in s and "team-1" not in s for s in salts)
        assert alice == again  # one key, one tenant: its requests share their cache
        assert not set(alice) & set(bob)
    run(main())


def test_without_isolation_requests_keep_their_own_salt_only() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, auth=Auth(KEYS)) as http:
                salts = await _salts_of_every_door(http, eng, ALICE)
        assert salts == [None, None, None, "team-1", None, None, None, None]
    run(main())


def parse(argv: list[str]) -> argparse.Namespace:
    from gateway.cli import build_parser

    return build_parser().parse_args(["gateway", "--engine-address", "tcp://e:1", *argv])


def test_keys_from_flags_file_and_environment(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_API_KEY_FILE", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# team a\nsk-a\n\n  sk-b  \nsk-a\n")
    assert auth_of(parse(["--api-key", "k1", "k2", "--api-key", "k3"])).keys == ("k1", "k2", "k3")
    assert auth_of(parse(["--api-key-file", str(keys), "--api-key",
                          "k1"])).keys == ("k1", "sk-a", "sk-b")
    assert auth_of(parse([])).keys == ()
    monkeypatch.setenv("CONVEYOR_API_KEY", "e1\ne2\n")
    assert auth_of(parse([])).keys == ("e1", "e2")
    assert auth_of(parse(["--api-key", "k1"])).keys == ("k1",)  # the command line wins
    monkeypatch.setenv("CONVEYOR_API_KEY", "")  # compose's default: no key
    monkeypatch.setenv("CONVEYOR_API_KEY_FILE", str(keys))
    auth = auth_of(parse(["--cache-isolation", "per-key"]))
    assert auth.keys == ("sk-a", "sk-b") and auth.per_key and "sk-a" not in repr(auth)
    # serve's workers get every key by environment, and read the same set back
    monkeypatch.delenv("CONVEYOR_API_KEY_FILE")
    monkeypatch.setenv("CONVEYOR_API_KEY", worker_env(auth)["CONVEYOR_API_KEY"])
    assert auth_of(parse([])).keys == auth.keys


def test_bad_key_flags_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    monkeypatch.delenv("CONVEYOR_API_KEY_FILE", raising=False)
    (tmp_path / "empty").write_text("# nobody yet\n\n")
    for argv, says in ((["--api-key-file", str(tmp_path / "missing")], "cannot read"),
                       (["--api-key-file", str(tmp_path / "empty")], "has no keys"),
                       (["--cache-isolation", "per-tenant"], "invalid choice")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert says in capsys.readouterr().err
    from gateway.__main__ import main

    with pytest.raises(SystemExit, match="per-key needs API keys"):  # before any engine starts
        main(["serve", "--cache-isolation", "per-key"])
    with pytest.raises(ValueError, match="control character"):
        auth_of(parse(["--api-key", "sk-a\nsk-b"]))  # would reach serve's workers as two keys
