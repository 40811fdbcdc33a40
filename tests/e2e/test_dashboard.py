"""GET /dashboard in a real browser (Debian's chromium, driven by playwright) against a real
`conveyor serve` whose small KV pool forces swaps while prompts share a prefix and an n=4 request
shares its blocks; the page is read from the DOM and checked against /metrics and the engine's own
snapshot. Also: the engine's outputs are the same with a viewer connected, and traces (the SDK
toggle, --trace-file) are well formed.

One server and one browser for the module. The page updates live, so every check polls the DOM until
its condition holds, with a generous deadline; nothing sleeps a fixed time.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.metrics import parse
from tests.e2e.conftest import TINY_CHAT
from tests.e2e.servers import Server, wait_engine_idle
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
# 3 blocks of 8 every long prompt starts with: prefix-cache sharing
PREFIX = list(range(1000, 1024))
DEADLINE = 60.0
NUM_BLOCKS = 64
# the page's uncaught exceptions and console errors, for failure messages
PAGE_ERRORS: list[str] = []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory,
          make_tiny_checkpoint: Callable[..., Path]) -> Path:
    """The tiny chat model, wider and deeper: steps slow enough (milliseconds) that the page sees
    each phase."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("models") / "dash-chat"
    make_tiny_checkpoint(folder, LlamaConfig, LlamaForCausalLM, seed=4,
                         **{**TINY_CHAT, "hidden_size": 256, "intermediate_size": 512,
                            "num_hidden_layers": 4})
    smollm2_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dash-trace") / "trace.json"


@pytest.fixture(scope="module")
def server(model: Path, trace_file: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dash") / "server.log"
    # 64 blocks of 8 (512 tokens) for an n=4 request that grows to 50 of them and six requests of up
    # to 32 + 120 tokens (19 blocks each): most wait swapped out (a CPU pool of 128 blocks), and the
    # running ones share the prefix's blocks.
    with Server(["serve", "--model", str(model), "--num-threads", "1", "--num-blocks",
                 str(NUM_BLOCKS), "--block-size", "8", "--swap-space", "4MiB", "--preemption-mode",
                 "swap", "--api-key", KEY, "--trace-file", str(trace_file), "--log-level", "info"],
                log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def page(server: Server) -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1500, "height": 1100})
            pg.on("pageerror", lambda e: PAGE_ERRORS.append(f"uncaught: {e}"))
            pg.on("console", console_error)
            pg.goto(f"{server.url}/dashboard?api_key={KEY}")
            wait_until(lambda: pg.text_content("#status") == "live",
                       "the page's socket never opened")
            yield pg
        finally:
            browser.close()


def console_error(msg: Any) -> None:
    if msg.type == "error":
        PAGE_ERRORS.append(msg.text)


def wait_until(cond: Callable[[], Any], what: str, timeout: float = DEADLINE,
               server: Server | None = None) -> Any:
    """Polls cond; on timeout fails naming `what`, with the page's errors and (given the server)
    the end of its log: a page that never updates is otherwise a mystery in CI."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            log = f"\nserver log:\n{server.log()[-2000:]}" if server is not None else ""
            raise AssertionError(f"within {timeout:g}s: {what}; page errors: {PAGE_ERRORS[-5:]}"
                                 f"{log}")
        time.sleep(0.05)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers=AUTH)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def metrics(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def in_thread(fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Work outside the test's thread, which playwright's sync API holds (asyncio.run needs a
    thread too)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut


def workload(url: str) -> list[Any]:
    """An n=4 request, then (once it runs) six long prompts on one prefix, which swap;
    -> their bodies.

    The n=4 request goes first and, at a higher priority, is never preempted: its forks share their
    prompt's blocks for all of its 96 steps, many snapshots long on any CPU. Sent among the others
    it could wait until the swapped queue drained (waiting requests are admitted only then) and run
    in a fraction of a second."""
    n4 = {"prompt": list(range(3000, 3016)), "n": 4, "max_tokens": 96, "temperature": 1.0,
          "seed": 7, "ignore_eos": True, "priority": -1}
    bodies = [{"prompt": PREFIX + [2000 + 10 * i + j for j in range(8)], "max_tokens": 120,
               "temperature": 0, "ignore_eos": True} for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(1 + len(bodies)) as pool:
        first = pool.submit(post, url, n4)
        wait_until(lambda: metrics(url)["conveyor_num_requests_running"] > 0,
                   "the n=4 request never ran")
        rest = [pool.submit(post, url, b) for b in bodies]
        return [f.result() for f in (first, *rest)]


def short_workload(url: str) -> list[list[str]]:
    bodies = [{"prompt": "The engine", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
              {"prompt": "Paged attention", "max_tokens": 12, "temperature": 0.9, "seed": 3, "n": 2,
               "ignore_eos": True}]
    return [[c["text"] for c in post(url, b)["choices"]] for b in bodies]


def dom(page: Any) -> dict[str, Any]:
    """What the page shows, read in one go."""
    return page.evaluate("""() => {
        const n = (id) => Number(document.getElementById(id).textContent);
        const all = (q) => [...document.querySelectorAll(q)];
        const rows = (q) => all(`#queue-${q} tr`).map((tr) => tr.cells[0].textContent);
        const shared = all('#blocks .cell.shared').map((c) => c.dataset.holder);
        return {step: n('step'), running: n('count-running'), swapped: n('count-swapped'),
                waiting: n('count-waiting'), kv_used: n('kv-used'), kv_total: n('kv-total'),
                used_cells: document.querySelectorAll('#blocks .cell.used').length,
                cells: document.querySelectorAll('#blocks .cell').length,
                cpu_used_cells: document.querySelectorAll('#cpu-blocks .cell.used').length,
                rows: {running: rows('running'), swapped: rows('swapped'),
                       waiting: rows('waiting')},
                shared};
    }""")


def test_the_page_is_behind_the_api_key_and_self_contained(server: Server) -> None:
    for path in ("/dashboard", "/dashboard/ws"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server.url}{path}", timeout=10)
        assert e.value.code == 401
    req = urllib.request.Request(f"{server.url}/dashboard",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        html = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/html")
    assert "<script>" in html and "/*SCRIPT*/" not in html and "/*STYLE*/" not in html
    assert "http://" not in html and "https://" not in html  # nothing is fetched from elsewhere


def test_engine_outputs_are_the_same_with_a_viewer_connected(server: Server, page: Any) -> None:
    # The page fixture is connected now; close its socket to run without a viewer first.
    page.goto("about:blank")
    without = short_workload(server.url)
    page.goto(f"{server.url}/dashboard?api_key={KEY}")
    wait_until(lambda: page.text_content("#status") == "live", "the page's socket never opened")
    first = dom(page)["step"]
    viewed = in_thread(lambda: short_workload(server.url))
    wait_until(lambda: dom(page)["step"] > first, "the step counter never advanced",
               server=server)
    assert viewed.result(timeout=120) == without


def test_dashboard_shows_queues_blocks_and_steps_live(server: Server, page: Any,
                                                      tmp_path: Path) -> None:
    # the first snapshot after the page (re)connected
    start = wait_until(lambda: (d := dom(page))["kv_total"] == NUM_BLOCKS and d,
                       "the page never showed the KV pool", server=server)
    assert start["cells"] == NUM_BLOCKS
    load = in_thread(lambda: workload(server.url))

    def swapped(d: dict[str, Any]) -> bool:
        rows = d["rows"]["swapped"]
        return bool(rows) and d["swapped"] == len(rows) and bool(d["cpu_used_cells"])

    def n4_shares(d: dict[str, Any]) -> bool:
        n4 = {r.split("#")[0] for q in d["rows"].values() for r in q if "#" in r}
        return bool(n4 & set(d["shared"]))

    def used_cells_match(d: dict[str, Any]) -> bool:
        return bool(d["used_cells"] == d["kv_used"] > 0)

    def counts_match_metrics(d: dict[str, Any]) -> bool:
        m = metrics(server.url)
        got = (d["running"], d["swapped"], d["waiting"])
        want = (m["conveyor_num_requests_running"], m["conveyor_num_requests_swapped"],
                m["conveyor_num_requests_waiting"])
        return got == want and sum(got) > 0 and sum(len(r) for r in d["rows"].values()) == sum(got)

    # Each state is looked for in every poll while the load runs, not one after another: a
    # short-lived one (the n=4 request's shared blocks) may come and go while the test still waits
    # for an earlier one.
    checks = {"a request in the swapped queue": swapped,
              "a shared block of the n=4 request while it ran": n4_shares,
              "used cells equal to the engine's used blocks": used_cells_match,
              "queue counts equal to /metrics under load": counts_match_metrics}
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + DEADLINE
    while len(seen) < len(checks) and time.monotonic() < deadline:
        d = dom(page)
        for what, check in checks.items():
            if what not in seen and check(d):
                seen[what] = d
                if what == "a request in the swapped queue":
                    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        time.sleep(0.05)
    never = sorted(checks.keys() - seen.keys())
    assert not never, f"the page never showed: {never}"
    print(f"screenshot: {tmp_path / 'dashboard.png'}")
    if os.environ.get("CONVEYOR_DOCS_SCREENSHOT"):  # how docs/dashboard.png is made
        shutil.copy(tmp_path / "dashboard.png", os.environ["CONVEYOR_DOCS_SCREENSHOT"])
    assert seen["a request in the swapped queue"]["step"] > start["step"]

    bodies = load.result(timeout=180)
    assert [len(b["choices"]) for b in bodies] == [4] + [1] * 6
    m = metrics(server.url)
    assert m["conveyor_num_preemptions_total"] > 0

    def idle() -> bool:
        d = dom(page)
        return d["used_cells"] == d["kv_used"] == 0 and (d["running"], d["swapped"],
                                                         d["waiting"]) == (0, 0, 0)
    wait_until(idle, "the page never showed the engine idle")
    m = metrics(server.url)
    assert m["conveyor_kv_cache_usage_ratio"] == 0 and m["conveyor_num_requests_running"] == 0


def test_sdk_trace_toggle(server: Server, tmp_path: Path) -> None:
    from shared.client import AsyncEngineClient

    async def main() -> dict[str, Any]:
        async with AsyncEngineClient(server.engine_address, name="tracer") as client:
            await client.start_trace()
            await asyncio.to_thread(short_workload, server.url)
            return await client.stop_trace(tmp_path / "sdk.json")

    trace = in_thread(lambda: asyncio.run(asyncio.wait_for(main(), 120))).result(timeout=150)
    assert json.loads((tmp_path / "sdk.json").read_text()) == trace
    check_trace(trace["traceEvents"], min_requests=2)


def test_trace_file_is_written_when_the_server_stops(server: Server, trace_file: Path) -> None:
    """Last in the module: it stops the server."""
    short_workload(server.url)
    in_thread(lambda: asyncio.run(wait_engine_idle(server.engine_address))).result(timeout=60)
    assert server.stop() == 0
    check_trace(json.loads(trace_file.read_text())["traceEvents"], min_requests=2)


def check_trace(events: list[dict[str, Any]], min_requests: int) -> None:
    steps = [e for e in events if e["pid"] == 1 and e["name"].startswith("step ")]
    phases = [e for e in events if e["pid"] == 1 and e["ph"] == "X"
              and not e["name"].startswith("step ")]
    assert steps and len(phases) == 5 * len(steps)
    numbers = [int(e["name"].split()[1]) for e in steps]
    assert len(set(numbers)) == len(numbers)
    requests = [e for e in events if e["pid"] == 2 and e["name"].startswith("request ")]
    assert len(requests) >= min_requests
    for req in requests:
        children = [e for e in events if e["pid"] == 2 and e["tid"] == req["tid"] and e is not req
                    and e["ph"] == "X"]
        assert {"queued", "prefill"} <= {c["name"] for c in children}
        for c in children:
            assert req["ts"] <= c["ts"] and c["ts"] + c["dur"] <= req["ts"] + req["dur"] + 1e-3
