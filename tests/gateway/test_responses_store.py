"""The stored responses' LRU bound and tenant scoping, in one process's memory and in the SQLite
file that `serve --gateway-workers N` shares: what one connection stores another finds, touches and
evicts, and writers in separate processes neither fail nor overrun the bound."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.responses_store import NotFound, ResponseStore, Stored


def stored(n: int) -> Stored:
    """A response whose every part says which it is (and survives the JSON round trip)."""
    return Stored({"id": f"r{n}", "output": [{"text": "é" * n}]},
                  [{"role": "user", "content": str(n)}], [{"id": f"msg_{n}", "type": "message"}])


def ids(store: ResponseStore, candidates: range, owner: str | None = None) -> list[str]:
    """Which of the candidates the store holds (find touches them: tests look last)."""
    return [f"r{n}" for n in candidates if store.find(f"r{n}", owner) is not None]


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ResponseStore:
    s = ResponseStore(3, None if request.param == "memory" else str(tmp_path / "responses.sqlite"))
    request.addfinalizer(s.close)
    return s


def test_the_least_recently_used_goes_first(store: ResponseStore) -> None:
    for n in range(3):
        store.put(f"r{n}", stored(n))
    assert store.get("r0") == stored(0)  # r0 is now the most recently used: r1 is the oldest
    store.put("r3", stored(3))
    assert len(store) == 3 and store.find("r1") is None
    store.put("r2", stored(20))  # storing again replaces and touches: r0 is the oldest now
    store.put("r4", stored(4))
    assert ids(store, range(5)) == ["r2", "r3", "r4"] and store.get("r2") == stored(20)


def test_a_tenant_sees_only_its_own(store: ResponseStore) -> None:
    store.put("r1", stored(1), owner="alice")
    store.put("r1", stored(2), owner="bob")  # the same id under another key: another response
    assert store.get("r1", owner="alice") == stored(1) and store.get("r1", owner="bob") == stored(2)
    for owner in (None, "carol"):
        assert store.find("r1", owner) is None
        with pytest.raises(NotFound) as e:
            store.get("r1", "previous_response_id", owner)
        assert e.value.status == 404 and e.value.param == "previous_response_id"
        with pytest.raises(NotFound):
            store.delete("r1", owner)
    store.delete("r1", "bob")
    assert store.find("r1", "bob") is None and store.get("r1", owner="alice") == stored(1)
    with pytest.raises(NotFound):
        store.delete("r1", "bob")


def test_size_zero_stores_nothing() -> None:
    store = ResponseStore(0)
    store.put("r1", stored(1))
    assert len(store) == 0 and store.find("r1") is None


def test_connections_to_one_file_share_entries_and_recency(tmp_path: Path) -> None:
    """Two gateway workers: one stores, the other finds; a find on either moves the entry up for
    both."""
    path = str(tmp_path / "responses.sqlite")
    a, b = ResponseStore(2, path), ResponseStore(2, path)
    a.put("r0", stored(0))
    b.put("r1", stored(1))
    # r0 touched by b: r1 is the oldest
    assert a.get("r1") == stored(1) and b.get("r0") == stored(0)
    a.put("r2", stored(2))
    assert ids(b, range(3)) == ["r0", "r2"]
    b.delete("r2")
    assert a.find("r2") is None
    a.close()
    b.close()


WRITER = """
import sys
from gateway.responses_store import ResponseStore, Stored
store = ResponseStore(50, sys.argv[1])
for n in range(300):
    rid = f"{sys.argv[2]}-{n}"
    store.put(rid, Stored({"id": rid}, [], []))
    store.find(f"{sys.argv[2]}-{n // 2}")  # touches while the others write (it may be gone by now)
"""


def test_writers_in_separate_processes_keep_the_bound(tmp_path: Path) -> None:
    """Three gateway workers storing at once: each write waits its turn (none fails), and the bound
    holds. Which entries survive depends on the interleaving: exact LRU order is the tests above."""
    path = str(tmp_path / "responses.sqlite")
    ResponseStore(50, path).close()  # as gateway/topology.py does before the workers start
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, name],
                              cwd=Path(__file__).parents[2]) for name in ("a", "b", "c")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    store = ResponseStore(50, path)
    assert len(store) == 50  # no writer failed on a locked database, and none overran the bound
    store.close()
