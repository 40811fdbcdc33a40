"""Where a reasoning model's output reasons, by token ids: one state machine for the engine (which
forces the end of the reasoning at a thinking budget, engine/thinking.py) and for the client side
(which counts reasoning tokens for `usage`, shared/choices.py).

The gateway tokenizes the reasoning parser's tags (`<think>`, `</think>`) with the model's tokenizer
and sends their ids in SamplingParams (reasoning_start_ids, reasoning_end_ids); the engine never
sees text. A state is an int or None, immutable, so a forked sequence copies it with its tokens:

    WAITING  the output has not written the start ids yet (the prompt did not open the block)
    k >= 0   reasoning began at index k of the caller's token list (the output's first index: the
             prompt opened the block; else just after the start ids)
    None     the reasoning ended (the end ids were written, or forced), or is not tracked

Matching is by ids where a tag is one token (Qwen3, QwQ, the DeepSeek-R1 distills): exact. A tag of
several tokens (a tokenizer without `<think>` in its vocabulary, as SmolLM2's) has many spellings:
the one its ids give alone (`</`, `think`, `>`) and those the model writes in context (` </` after a
space, `>` merged with what follows, ...). Where the caller has the tokens' text (the client side,
shared/choices.py), such a tag is matched on the decoded text, as vLLM's reasoning parsers do for
tokenizers without the tags as tokens, so reasoning_tokens agrees with the text split (gateway/
reasoning.py). The engine has no text: the gateway sends the end tag's spellings in context as ids
(SamplingParams.reasoning_end_spellings, found with its tokenizer: gateway/reasoning.py), and the
budget ends on any of them. A spelling outside that list still leaves the budget running.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest

# token id -> its text decoded alone (shared/choices.py TokenStrings)
Strings = Callable[[int], str]
WAITING = -1
MAX_TAG_IDS = 32  # reasoning_start_ids / reasoning_end_ids: a tag's tokens, not a payload
MAX_SPELLINGS = 64  # reasoning_end_spellings: a tag's contexts, not a payload
MAX_TOKEN_ID = (1 << 31) - 1  # shared/sampling.py's bounds for the wire
MAX_BUDGET = 1 << 20  # shared/sampling.py's MAX_TOKENS


def initial(start_ids: Sequence[int], end_ids: Sequence[int], begin: int) -> int | None:
    """The state before the first output token; begin: where the output starts in the token list the
    caller passes (the engine's holds the prompt too)."""
    if not end_ids:
        return None
    return WAITING if start_ids else begin


@dataclass(frozen=True, slots=True)
class Tag:
    """One reasoning tag as a matcher looks for it: ids, its tokens alone (what the engine forces
    unless the output began another spelling); spellings, the other ids the model writes it as in
    context, in order of preference; text, where the caller has the tokens' text and the tag is
    several tokens of text, what it is matched on instead (`tag_text`, joined once per choice)."""

    ids: tuple[int, ...]
    spellings: tuple[tuple[int, ...], ...] = ()
    text: str = ""

    @property
    def all_ids(self) -> tuple[tuple[int, ...], ...]:
        return (self.ids, *self.spellings)


def tag_text(ids: Sequence[int], strings: Strings) -> str:
    """The text a tag of several ids is matched on, joined once per choice; "" (match the ids) for
    one id, or a tag of special tokens, which have no text."""
    return "".join(strings(t) for t in ids) if len(ids) > 1 else ""


def after(state: int | None, tokens: Sequence[int], begin: int, start: Tag, end: Tag,
          strings: Strings | None = None) -> int | None:
    """The state once tokens (the output from index begin) has grown by its last token; strings:
    the tokens' text, for a tag with text."""
    if state is None:
        return None
    if state == WAITING:
        return len(tokens) if _tag_ends(tokens, start, begin, strings) else WAITING
    return None if _tag_ends(tokens, end, state, strings) else state


def _tag_ends(tokens: Sequence[int], tag: Tag, begin: int, strings: Strings | None) -> bool:
    """Does the last token complete tag in tokens[begin:]: by its text (given it and strings),
    else by its ids or any of its spellings."""
    if strings is not None and tag.text:
        return len(tokens) > begin and _text_ends(tokens, tag.text, begin, strings)
    last = tokens[-1] if len(tokens) > begin else None
    return any(s[-1] == last and _ends_with(tokens, s, begin) for s in tag.all_ids if s)


def _text_ends(tokens: Sequence[int], text: str, begin: int, strings: Strings) -> bool:
    """Is text in the text of tokens[begin:], ending inside the last token's? (An earlier
    end was seen at its own token.) Only the tail that can hold it is joined: one step
    costs the tag's length."""
    last = strings(tokens[-1])
    tail, i = last, len(tokens) - 1
    while len(tail) < len(text) + len(last) - 1 and i > begin:
        i -= 1
        tail = strings(tokens[i]) + tail
    return tail.find(text, max(0, len(tail) - len(last) - len(text) + 1)) >= 0


def forced(state: int | None, tokens: Sequence[int], budget: int, end: Tag) -> int | None:
    """The token the output must take next: once `budget` reasoning tokens are out, the next id of
    the spelling of the end tag the output has begun most of (the first one on a tie: its ids when
    none is begun), else None."""
    if state is None or state == WAITING or len(tokens) - state < budget:
        return None
    spelling = max(end.all_ids, key=lambda s: _partial(tokens, s, state))
    return spelling[_partial(tokens, spelling, state)]


def span(state: int, tokens: Sequence[int], start_ids: Sequence[int]) -> int:
    """Reasoning tokens so far of a state that reasons (k >= 0), its tags included."""
    return len(tokens) - state + len(start_ids)


def _ends_with(tokens: Sequence[int], tag: Sequence[int], begin: int) -> bool:
    n = len(tag)
    return len(tokens) - begin >= n and all(tokens[len(tokens) - n + i] == t
                                            for i, t in enumerate(tag))


def _partial(tokens: Sequence[int], tag: Sequence[int], begin: int) -> int:
    """The longest proper prefix of tag that tokens[begin:] ends with."""
    for j in range(min(len(tag) - 1, len(tokens) - begin), 0, -1):
        if _ends_with(tokens, tag[:j], begin):
            return j
    return 0


def as_tuples(params: Any) -> dict[str, Any]:
    """SamplingParams' reasoning fields as they arrive (JSON lists) -> tuples, so the frozen record
    stays hashable; validate checks the ids."""
    fields = {"reasoning_start_ids": params.reasoning_start_ids,
              "reasoning_end_ids": params.reasoning_end_ids}
    for name, ids in fields.items():
        if not isinstance(ids, list | tuple):
            raise InvalidRequest(f"{name} must be a list, got {ids!r}"[:200], param=name)
        fields[name] = tuple(ids)
    end_spellings = params.reasoning_end_spellings
    if not isinstance(end_spellings, list | tuple) or not all(isinstance(s, list | tuple)
                                                              for s in end_spellings):
        raise InvalidRequest("reasoning_end_spellings must be a list of lists of token ids",
                             param="reasoning_end_spellings")
    return fields | {"reasoning_end_spellings": tuple(tuple(s) for s in end_spellings)}


def validate(start_ids: Sequence[int], end_ids: Sequence[int], budget: int | None,
             beam_search: bool, constrained: bool,
             end_spellings: Sequence[Sequence[int]] = ()) -> None:
    """SamplingParams' reasoning fields (ranges, and what a budget cannot be combined with), as
    SamplingParams.validate checks the others: InvalidRequest naming the field."""
    for name, ids in (("reasoning_start_ids", start_ids), ("reasoning_end_ids", end_ids)):
        _check(len(ids) <= MAX_TAG_IDS, name, f"may hold at most {MAX_TAG_IDS} ids, got {len(ids)}")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids), name,
               f"must hold integer token ids in [0, {MAX_TOKEN_ID}]")
    _check(bool(end_ids) or not start_ids, "reasoning_start_ids", "need reasoning_end_ids too")
    name = "reasoning_end_spellings"
    _check(len(end_spellings) <= MAX_SPELLINGS, name,
           f"may hold at most {MAX_SPELLINGS} spellings, got {len(end_spellings)}")
    _check(all(0 < len(s) <= MAX_TAG_IDS and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in s)
               for s in end_spellings), name,
           f"must hold lists of 1 to {MAX_TAG_IDS} integer token ids in [0, {MAX_TOKEN_ID}]")
    _check(bool(end_ids) or not end_spellings, name, "need reasoning_end_ids too")
    if budget is None:
        return
    _check(_is_int(budget) and 0 <= budget <= MAX_BUDGET, "thinking_token_budget",
           f"must be an integer in [0, {MAX_BUDGET}], got {repr(budget)[:50]}")
    _check(bool(end_ids), "thinking_token_budget", "needs reasoning_end_ids: the tokens that end "
           "the reasoning (the gateway sends them where it runs a reasoning parser)")
    _check(not beam_search, "thinking_token_budget", "cannot be used with beam search")
    # The grammar decides every token, and the forced end ids may be tokens it does not allow.
    _check(not constrained, "thinking_token_budget",
           "cannot be used with structured output or a forced tool call")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, param: str, why: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param} {why}", param=param)
