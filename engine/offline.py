"""Offline API: the same EngineCore, in-process, no sockets. For batch jobs, tests and benchmarks.

    llm = LLM(model="SmolLM2-135M-Instruct")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from engine.core import EngineCore
from shared.config import EngineConfig, build_config
from shared.protocol import Error
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class SequenceOutput:
    """One of a request's sequences (n > 1 or beam search return several, by index)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput] = field(default_factory=list)  # in index order
    # the engine failed this request (finish_reason "error"); the others went on
    error: str | None = None

    # The first sequence's fields: the whole answer of an n = 1 request.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def text(self) -> str | None:
        return self.outputs[0].text


class LLM:
    def __init__(self, model: str = EngineConfig.model, **engine_options: Any) -> None:
        self.core = EngineCore(build_config(model, **engine_options))
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._counter = 0

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            from shared.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.core.source)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            ids: list[int] = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                              else list(prompt))
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.core.add(rid, ids, p)
            outputs[rid] = CompletionOutput(rid, ids)
            order.append(rid)
        seqs: dict[str, dict[int, SequenceOutput]] = {rid: {} for rid in order}
        with tqdm(total=len(order), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.core.has_work():
                for out in self.core.step():
                    if isinstance(out, Error):
                        assert out.request_id is not None
                        outputs[out.request_id].error = out.message
                        failed = seqs[out.request_id].setdefault(0, SequenceOutput(0))
                        failed.finish_reason = "error"
                        bar.update(1)
                        continue
                    seq = seqs[out.request_id].setdefault(out.index, SequenceOutput(out.index))
                    seq.token_ids.extend(out.new_token_ids)
                    seq.finish_reason = out.finish_reason or seq.finish_reason
                    if out.finished:
                        bar.update(1)
        results = [outputs[rid] for rid in order]
        for o in results:
            o.outputs = [seqs[o.request_id][i] for i in sorted(seqs[o.request_id])]
        if any(isinstance(p, str) for p in prompts):
            for seq in (s for o in results for s in o.outputs):
                seq.text = str(self.tokenizer.decode(seq.token_ids, skip_special_tokens=True))
        return results
