"""shared/thinking.py, the reasoning part found by its tags' ids, and the reasoning_tokens that
shared/choices.py counts with it: whatever the delta sizes, and per choice."""
from __future__ import annotations

import pytest

from shared import thinking
from shared.choices import Choices, TokenStrings
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.fakes import smollm2_tokenizer

OPEN, CLOSE = [7, 8], [9, 10, 11]
END = thinking.Tag(tuple(CLOSE))


def states(output: list[int], start: list[int]) -> list[int | None]:
    state, out = thinking.initial(start, CLOSE, 0), []
    for n in range(1, len(output) + 1):
        state = thinking.after(state, output[:n], 0, thinking.Tag(tuple(start)), END)
        out.append(state)
    return out


def test_states_open_at_the_start_ids_and_end_at_the_end_ids() -> None:
    w = thinking.WAITING
    assert states([1, 7, 8, 2, 9, 10, 11, 3], OPEN) == [w, w, 3, 3, 3, 3, None, None]
    assert states([1, 9, 10, 11, 2], []) == [0, 0, 0, None, None]  # the prompt opened it
    # an end before the start
    assert states([9, 10, 7, 8, 9, 10, 11], OPEN) == [w, w, w, 4, 4, 4, None]
    assert thinking.initial(OPEN, [], 0) is None  # no end ids: nothing tracked


def test_forced_is_the_rest_of_the_end_ids_once_the_budget_is_spent() -> None:
    assert thinking.forced(0, [1, 2], 3, END) is None
    assert thinking.forced(0, [1, 2, 3], 3, END) == 9
    assert thinking.forced(0, [1, 2, 9], 3, END) == 10  # the model began the tag
    assert thinking.forced(0, [1, 2, 9, 10], 3, END) == 11
    # a tag's prefix before the reasoning is not one
    assert thinking.forced(2, [9, 10, 1], 1, END) == 9
    assert thinking.forced(thinking.WAITING, [1, 2, 3], 0, END) is None


@pytest.mark.parametrize("size", [1, 2, 3, 100])
@pytest.mark.parametrize(("output", "start", "want"), [
    ([1, 2, 9, 10, 11, 3, 4], [], 5),  # the prompt opened it: 2 tokens and the tag
    ([7, 8, 1, 9, 10, 11, 3], OPEN, 6),  # the output opens it: both tags count
    ([1, 2, 3], [], 3),  # never closed: all of it
    ([1, 2, 3], OPEN, 0),  # never opened
])
def test_choices_count_reasoning_tokens_whatever_the_delta_sizes(
    output: list[int], start: list[int], want: int, size: int,
) -> None:
    params = SamplingParams(max_tokens=64, reasoning_start_ids=tuple(start),
                            reasoning_end_ids=tuple(CLOSE), n=2)
    tok = smollm2_tokenizer()
    choices = Choices("r", 4, params, tok, TokenStrings(tok))
    last = None
    for index in (0, 1):  # both choices write the same: the request's count is twice one's
        for i in range(0, len(output), size):
            done = i + size >= len(output)
            row = RequestOutput("r", output[i:i + size], finished=done and index == 1,
                                finish_reason="length" if done else None, index=index)
            last = choices.feed(row)[-1]
    assert last is not None and last.finished and last.num_reasoning_tokens == 2 * want
