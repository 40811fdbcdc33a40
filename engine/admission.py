"""The engine's door: a request is checked against the model and this engine's limits when it
arrives, so that nothing it carries can raise later, inside a step, where it would hurt every
other request. SamplingParams.validate (shared/) has already checked each field on its own; this
adds what only the engine knows: the vocabulary, the context length, the sequence cap and the
size of the KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import blocks_for
from shared.errors import InvalidRequest
from shared.sampling import SamplingParams

# (token, logprob) pairs of one request's prompt logprobs: about 30 bytes each on the wire, so one
# row stays well under a client's message limit (shared/wire.py CLIENT_MAX_MESSAGE_SIZE).
MAX_PROMPT_LOGPROB_PAIRS = 1 << 20


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    # the most blocks a sequence holds (BlockManager.max_live_blocks)
    max_seq_blocks: int | None = None

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequest naming the field when the request can never run as asked."""
        vocab = self.vocab_size
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        tags = {"reasoning_start_ids": params.reasoning_start_ids,
                "reasoning_end_ids": params.reasoning_end_ids,
                "reasoning_end_spellings": [t for s in params.reasoning_end_spellings for t in s]}
        for name, ids in tags.items():
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(f"{name} must be in [0, {vocab})", param=name)
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})",
                                 param="logit_bias")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this model serves at most "
                f"{self.max_model_len} tokens including at least one generated token",
                param="prompt",
                code="context_length_exceeded")
        k = params.prompt_logprobs
        if k is not None and len(prompt_token_ids) * (k + 1) > MAX_PROMPT_LOGPROB_PAIRS:
            raise InvalidRequest(f"prompt logprobs with {k} alternatives for "
                                 f"{len(prompt_token_ids)} prompt tokens exceed "
                                 f"{MAX_PROMPT_LOGPROB_PAIRS} entries: ask for fewer alternatives",
                                 param="prompt_logprobs")
        if params.num_seqs > self.max_num_seqs:
            what = ("beam_width" if params.use_beam_search
                    else "best_of" if params.best_of else "n")
            raise InvalidRequest(f"{what} asks for {params.num_seqs} sequences; this engine runs "
                                 f"at most {self.max_num_seqs} at once (--max-num-seqs)",
                                 param=what)
        if params.use_beam_search:
            # Beams step together, so all of them must fit the pool at once, even unshared (after a
            # preemption by recompute each beam holds its own copy of the prompt).
            length = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
            blocks = blocks_for(length, self.block_size)
            # sliding windows: a beam holds its window's blocks at most
            if self.max_seq_blocks is not None:
                blocks = min(blocks, self.max_seq_blocks)
            need = params.beam_width * blocks
            if need > self.num_blocks:
                raise InvalidRequest(
                    f"beam search of width {params.beam_width} over up to {length} tokens needs "
                    f"{need} KV blocks; "
                    f"this engine has {self.num_blocks} (lower beam_width or max_tokens)",
                    param="beam_width")
