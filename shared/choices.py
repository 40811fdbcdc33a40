"""The text of one request's choices (n / best_of / beam search), from its engine outputs.

The engine sends rows per sequence (`RequestOutput.index`); a choice's row with a finish_reason ends
that choice, and the row with `finished` ends the request. Each choice has its own incremental
detokenizer, so its own UTF-8 and stop-string hold-back: a stop string ends that choice only; the
request ends when every choice has ended.

Logprobs follow the text: a token's logprob goes out with the output that releases the last of its
text, and tokens cut off by a stop string are dropped together with their text. So a client that
joins the `token` strings of every logprob entry gets the text it was sent (whenever each token
decoded alone reads as it does in context, as with byte-level BPE on complete characters).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared import thinking
from shared.detokenizer import Decoder, IncrementalDetokenizer
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams


@dataclass(slots=True)
class TokenLogprob:
    """One generated token with its logprob and the most likely tokens at its position (best first).
    Token strings are the token decoded alone, as vLLM and OpenAI report them."""

    token_id: int
    token: str
    # None only when the engine sent no logprobs for a token that asked for them
    logprob: float | None
    top: list[tuple[int, str, float]]  # (token id, token, logprob)
    rank: int | None = None  # prompt tokens only: 1 = the most likely token at its position


@dataclass(slots=True)
class TextOutput:
    """One step of one choice of a text-level request: the new text and ids, plus counts for
    `usage`.

    finish_reason is set on the output that ends this choice (`index`); finished on the last output
    of the request, after which the stream ends. With n == 1 the two come together."""

    request_id: str
    text: str
    token_ids: list[int]  # the ids that arrived with this output (text held back included)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # of the request so far, over all its choices, including this output
    num_cached_tokens: int = 0
    index: int = 0
    # params.logprobs set: the tokens whose text `text` releases
    logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs set, on each choice's first output: one entry per prompt token (the
    # first has logprob None and no alternatives: nothing precedes it).
    prompt_logprobs: list[TokenLogprob] | None = None
    # the stop string that ended this choice (Anthropic's stop_sequence)
    stop_string: str | None = None
    # Of num_output_tokens, those in a reasoning part, tags included (params.reasoning_end_ids set,
    # by the gateway's reasoning parser: shared/thinking.py finds the part by its tags' ids).
    num_reasoning_tokens: int = 0


class TokenStrings:
    """Token id -> the token decoded alone, memoized (at most one entry per vocabulary id)."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._decoder.decode([token_id], skip_special_tokens=True,
                                                             clean_up_tokenization_spaces=False)
        return s


class Choice:
    """One choice's detokenizer, and with logprobs the tokens whose text is not released yet."""

    def __init__(self, decoder: Decoder, stop: Sequence[str], num_top: int | None,
                 strings: TokenStrings, params: SamplingParams | None = None) -> None:
        self.detok = IncrementalDetokenizer(decoder, stop)
        start, end = (params.reasoning_start_ids, params.reasoning_end_ids) if params else ((), ())
        # where this choice reasons (shared/thinking.py), by its tags' text joined once here
        self._thinking = thinking.initial(start, end, 0)
        self._start, self._end = (thinking.Tag(ids, text=thinking.tag_text(ids, strings))
                                  for ids in (start, end))
        self._seen: list[int] = []  # the output ids the state has taken, while it tracks
        self.reasoning_tokens = 0  # a reasoning part's tokens, once it ended
        self.finish_reason: str | None = None
        self._num_top, self._strings = num_top, strings
        self._released = 0  # characters of text sent
        # [token position, end of its text in the decoded text (None: not decoded yet), entry]
        self._pending: deque[list[Any]] = deque()

    @property
    def num_reasoning_tokens(self) -> int:
        state = self._thinking
        if state is None or state == thinking.WAITING:
            return self.reasoning_tokens
        return thinking.span(state, self._seen, self._start.ids)

    def _track(self, before: int) -> None:
        """The reasoning state over the tokens the detokenizer took since it held before of them."""
        for token in self.detok.token_ids[before:]:
            state = self._thinking
            if state is None:
                self._seen = []
                return
            self._seen.append(token)
            self._thinking = thinking.after(state, self._seen, 0, self._start, self._end,
                                            self._strings)
            if self._thinking is None and state != thinking.WAITING:
                self.reasoning_tokens = thinking.span(state, self._seen, self._start.ids)

    def step(self, ids: list[int], logprobs: list[list[Any]] | None,
             final: bool) -> tuple[str, list[TokenLogprob] | None]:
        """-> the text now safe to send, and (with logprobs) the entries of the tokens it
        completes."""
        before = len(self.detok.token_ids)
        try:
            return self._step(ids, logprobs, final)
        finally:
            if self._thinking is not None:
                self._track(before)

    def _step(self, ids: list[int], logprobs: list[list[Any]] | None,
              final: bool) -> tuple[str, list[TokenLogprob] | None]:
        if self._num_top is None:
            return self.detok.step(ids, final), None
        # a row that only ends the choice: flush what is held back, with its tokens' entries
        if not ids:
            text = self.detok.step([], final)
            return text, self._release(text, final)
        # One token at a time, so that each token's text has a known end in the decoded text.
        parts, entries = [], []
        for j, tok in enumerate(ids):
            if self.detok.stopped:
                break
            self._pending.append([len(self.detok.token_ids), None,
                                  self._entry(tok, logprobs[j] if logprobs else None)])
            text = self.detok.step([tok], final and j == len(ids) - 1)
            parts.append(text)
            entries += self._release(text, final and j == len(ids) - 1)
        return "".join(parts), entries

    def _release(self, text: str, final: bool) -> list[TokenLogprob]:
        self._released += len(text)
        decoded, end = self.detok.num_decoded_tokens, self.detok.num_decoded_chars
        for item in self._pending:
            if item[1] is None and item[0] < decoded:
                item[1] = end
        out = []
        while self._pending and (at := self._pending[0][1]) is not None and at <= self._released:
            out.append(self._pending.popleft()[2])
        if self.detok.stopped:
            self._pending.clear()  # cut by the stop string, with their text
        elif final:
            out += [item[2] for item in self._pending]
            self._pending.clear()
        return out

    def _entry(self, token_id: int, row: list[Any] | None) -> TokenLogprob:
        if row is None:
            return TokenLogprob(token_id, self._strings(token_id), None, [])
        lp, top = row
        assert self._num_top is not None
        # Beam search ranks 2 * beam_width candidates per step: report only what was asked for.
        return TokenLogprob(token_id, self._strings(token_id), lp,
                            [(t, self._strings(t), v) for t, v in top[:self._num_top]])


class Choices:
    """The choices of one request: engine rows in, TextOutputs out."""

    def __init__(self, request_id: str, num_prompt_tokens: int, params: SamplingParams,
                 decoder: Decoder, strings: TokenStrings,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self.request_id, self.num_prompt_tokens, self.params = request_id, num_prompt_tokens, params
        self.prompt_token_ids = prompt_token_ids  # to name the tokens of prompt logprobs
        self._decoder, self._strings = decoder, strings
        self._choices: dict[int, Choice] = {}
        self.num_ended = 0
        self.num_output_tokens = 0

    @property
    def done(self) -> bool:
        """Every choice has ended (a stop string may end them before the engine does)."""
        return self.num_ended >= self.params.n

    def choice(self, index: int) -> Choice:
        c = self._choices.get(index)
        if c is None:
            c = self._choices[index] = Choice(self._decoder, self.params.stop, self.params.logprobs,
                                              self._strings, self.params)
        return c

    def feed(self, out: RequestOutput) -> list[TextOutput]:
        """One engine row -> the outputs it completes (none for a choice that ended already). The
        row that finishes the request also ends the choices still open (an abort), the last output
        carrying `finished`."""
        outs = []
        c = self.choice(out.index)
        if c.finish_reason is None:
            reason = out.finish_reason or ("stop" if out.finished else None)
            outs.append(self._step(c, out.index, out, out.new_token_ids, reason))
        if out.finished:
            for index in range(self.params.n):
                other = self.choice(index)
                if other.finish_reason is None:
                    outs.append(self._step(other, index, out, [], out.finish_reason or "stop"))
            # the request ended on a choice a stop string had ended: say so, with no text
            if not outs:
                outs.append(self._output(out.index, out, "", [],
                                         [] if self.params.logprobs is not None else None,
                                         c.finish_reason))
        if outs:
            outs[-1].finished = out.finished or self.done
            if out.prompt_logprobs is not None:
                outs[0].prompt_logprobs = self._prompt_entries(out.prompt_logprobs)
        return outs

    def _prompt_entries(self, rows: list[Any]) -> list[TokenLogprob]:
        """The wire's [None, [logprob, rank, [[id, logprob], ...]], ...] -> one
        TokenLogprob per prompt token."""
        s, ids = self._strings, self.prompt_token_ids
        out = []
        for t, row in zip(ids, rows):
            if row is None:
                out.append(TokenLogprob(t, s(t), None, []))
            else:
                out.append(TokenLogprob(t, s(t), row[0], [(a, s(a), v) for a, v in row[2]], row[1]))
        return out

    def _step(self, c: Choice, index: int, out: RequestOutput, ids: list[int],
              reason: str | None) -> TextOutput:
        self.num_output_tokens += len(ids)
        text, entries = c.step(ids, out.logprobs if ids else None, final=reason is not None)
        if c.detok.stopped:
            reason = "stop"
        if reason is not None:
            c.finish_reason = reason
            self.num_ended += 1
        result = self._output(index, out, text, ids, entries, reason)
        result.stop_string = c.detok.stop_string
        return result

    def _output(self, index: int, out: RequestOutput, text: str, ids: list[int],
                entries: list[TokenLogprob] | None, reason: str | None) -> TextOutput:
        reasoning = sum(c.num_reasoning_tokens for c in self._choices.values())
        return TextOutput(self.request_id, text, ids, False, reason,
                          out.num_prompt_tokens or self.num_prompt_tokens, self.num_output_tokens,
                          out.num_cached_tokens, index, entries, num_reasoning_tokens=reasoning)


def join_outputs(parts: list[TextOutput], last: TextOutput) -> TextOutput:
    """One choice's outputs as one; counts from the request's last output."""
    reason = next((p.finish_reason for p in reversed(parts) if p.finish_reason), last.finish_reason)
    lps = None if parts[0].logprobs is None else [e for p in parts for e in (p.logprobs or [])]
    prompt = next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None)
    return TextOutput(last.request_id, "".join(p.text for p in parts),
                      [t for p in parts for t in p.token_ids], True, reason, last.num_prompt_tokens,
                      last.num_output_tokens, last.num_cached_tokens, parts[0].index, lps, prompt,
                      num_reasoning_tokens=last.num_reasoning_tokens)
