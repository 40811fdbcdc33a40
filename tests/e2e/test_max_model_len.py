"""`--max-model-len` reaches the engine's limits: a real `conveyor serve` reports the flag's value,
and a prompt over it is a 400 (the flag was once silently dropped between two config classes)."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
LIMIT = 48


@pytest.fixture(scope="module")
def client(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("max_model_len") / "server.log"
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "16MiB", "--max-model-len", str(LIMIT)]
    with Server(argv, log_path=log) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=30)


def test_the_flag_is_the_served_limit(client: openai.OpenAI) -> None:
    model = client.models.list().data[0]
    assert model.model_extra is not None and model.model_extra["max_model_len"] == LIMIT


def test_a_prompt_over_the_flag_is_refused(client: openai.OpenAI) -> None:
    # within the model's own 1024 positions, over the flag
    ids = [300 + i for i in range(LIMIT + 4)]
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {LIMIT}"):
        client.completions.create(model="tiny-chat", prompt=ids, max_tokens=1)
    short = client.completions.create(model="tiny-chat", prompt=ids[:LIMIT - 8], max_tokens=4,
                                      temperature=0)
    assert short.usage is not None and short.usage.prompt_tokens == LIMIT - 8
