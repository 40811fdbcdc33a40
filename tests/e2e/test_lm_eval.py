"""EleutherAI's lm-evaluation-harness scores a real server through its `local-completions` model
(echo + logprobs for multiple choice, batched token-id prompts with batch_size 8) and gets, item by
item, what its own `hf` model computes on the same float32 weights. Tasks are written here into a
temporary folder: nothing is downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.servers import Server
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MC = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small blue whale"],
     "label": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "label": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " green", " the sea"],
     "label": 0},
    {"question": "Water freezes at", "choices": [" zero degrees", " one hundred degrees"],
     "label": 0},
    {"question": "A dog says", "choices": [" woof", " meow", " moo"], "label": 0},
    {"question": "The sun rises in the", "choices": [" east", " west"], "label": 0},
]
GEN = [{"question": q, "answer": a}
       for q, a in [("Say hello:", "hello"), ("Count: one, two,", "three"),
                    ("Colour of the sky:", "blue"), ("Opposite of up:", "down")]]


def write_tasks(folder: Path) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model: Path) -> Path:
    """The tasks, plus one item whose first choice is the model's own greedy continuation (so that
    is_greedy is true somewhere: a random model is greedy on no natural text)."""
    import torch

    from tests.reference import hf_folder_model

    tok, model = smollm2_tokenizer(), hf_folder_model(tiny_chat_model)
    for context in ("The colour of grass is", "My favourite food is", "The answer is", "I like",
                    "Hello"):
        ids = tok.encode(context)
        with torch.no_grad():
            best = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        text = tok.decode([best])
        if tok.encode(context + text) == ids + [best]:  # lm-eval tokenizes context + continuation
            MC.append({"question": context, "choices": [text, " green"], "label": 0})
            break
    else:
        pytest.fail("no context whose greedy token survives re-tokenization")
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("lm-eval") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "64MiB", "--dtype", "float32"], log_path=log) as srv:
        yield srv


def evaluate(model: str, model_args: dict[str, Any], tasks: Path,
             batch_size: int) -> dict[str, list]:
    """-> task -> per-item filtered responses, in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tasks)),
                                  batch_size=batch_size, log_samples=True, device="cpu",
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    assert out is not None
    return {t: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for t, samples in out["samples"].items()}


@pytest.fixture(scope="module")
def hf_results(tiny_chat_model: Path, tasks: Path) -> dict[str, list]:
    return evaluate("hf", {"pretrained": str(tiny_chat_model), "dtype": "float32"}, tasks,
                    batch_size=1)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_local_completions_equals_lm_evals_hf_model(server: Server, tiny_chat_model: Path,
                                                    tasks: Path, hf_results: dict[str, list],
                                                    batch_size: int) -> None:
    args = {"model": "tiny-chat", "base_url": f"{server.url}/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": str(tiny_chat_model),
            "tokenized_requests": True, "max_length": 1024}
    ours = evaluate("local-completions", args, tasks, batch_size)
    assert len(ours["tiny_mc"]) == len(MC) and len(ours["tiny_gen"]) == len(GEN)
    # per choice: (loglikelihood, is_greedy)
    for mine, theirs in zip(ours["tiny_mc"], hf_results["tiny_mc"]):
        assert len(mine) == len(theirs)
        for (ll, greedy), (ll_hf, greedy_hf) in zip(mine, theirs):
            assert abs(float(ll) - float(ll_hf)) < 1e-3 and bool(greedy) == bool(greedy_hf)
    assert ours["tiny_gen"] == hf_results["tiny_gen"] and any(text for (text,) in ours["tiny_gen"])
    # not a vacuous comparison: greedy on the model's own continuation, not greedy on the others
    assert {bool(g) for item in ours["tiny_mc"] for _, g in item} == {True, False}
