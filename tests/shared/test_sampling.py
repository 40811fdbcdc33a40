"""SamplingParams.validate: every refused input names its field, every boundary value is accepted.

The limits are the module's constants, so a test that changes them changes with them; what must not
change is that nothing outside them reaches the engine (overflow in beam scoring, NaN in the
softmax, integers too large for the wire) and that nothing is silently ignored."""
from __future__ import annotations

import math
from typing import Any

import pytest

from shared import protocol as P
from shared import sampling as S
from shared.errors import InvalidRequest, ProtocolError
from shared.sampling import SamplingParams

BEAM = {"use_beam_search": True, "beam_width": 4}

REFUSED: list[tuple[dict[str, Any], str]] = [
    # booleans are JSON booleans
    ({"ignore_eos": "false"}, "ignore_eos"), ({"ignore_eos": 0}, "ignore_eos"),
    ({"ignore_eos": None}, "ignore_eos"),
    ({"speculative": "true"}, "speculative"), ({"use_beam_search": 1}, "use_beam_search"),
    ({**BEAM, "early_stopping": 1}, "early_stopping"),
    ({**BEAM, "early_stopping": "always"}, "early_stopping"),
    # integers are ints: not bools, not floats
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": S.MAX_TOKENS + 1}, "max_tokens"),
    ({"top_k": 1.0}, "top_k"), ({"top_k": -1}, "top_k"), ({"top_k": S.MAX_TOP_K + 1}, "top_k"),
    ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"), ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": False}, "min_tokens"),
    ({"n": True}, "n"), ({"n": 0}, "n"), ({"n": S.MAX_N + 1}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2.0}, "best_of"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": S.MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"beam_width": 0, "use_beam_search": True}, "beam_width"),
    # numbers are finite and in range
    *[({name: bad}, name) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                       "frequency_penalty",
                                      "repetition_penalty", "length_penalty")
      for bad in (math.nan, math.inf, -math.inf, "1", True, None)],
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": S.MAX_TEMPERATURE * 1.01}, "temperature"),
    ({"temperature": 1e-30}, "temperature"),
    ({"temperature": S.MIN_TEMPERATURE / 2}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.0001}, "top_p"), ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-3}, "repetition_penalty"),
    ({"repetition_penalty": 101}, "repetition_penalty"),
    ({**BEAM, "length_penalty": 1000}, "length_penalty"),
    ({**BEAM, "length_penalty": -1000}, "length_penalty"),
    ({**BEAM, "length_penalty": 10.5}, "length_penalty"),
    # lists: types, lengths, counts
    ({"stop": {"a": 1}}, "stop"), ({"stop": [""]}, "stop"), ({"stop": [1]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["x"] * (S.MAX_STOP + 1)}, "stop"), ({"stop": ["x" * (S.MAX_STOP_LEN + 1)]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [S.MAX_TOKEN_ID + 1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(S.MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"), ({"logit_bias": {"5": math.nan}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"), ({"logit_bias": [[1.0, 1]]}, "logit_bias"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias"), ({"logit_bias": 3}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(S.MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
    # beam search refuses what it would otherwise ignore
    ({**BEAM, "temperature": 0.7}, "temperature"), ({**BEAM, "top_p": 0.9}, "top_p"),
    ({**BEAM, "top_k": 5}, "top_k"),
    ({**BEAM, "top_k": 1}, "top_k"), ({**BEAM, "min_p": 0.1}, "min_p"),
    ({**BEAM, "logit_bias": {"5": 1}}, "logit_bias"),
    ({**BEAM, "presence_penalty": 0.5}, "presence_penalty"),
    ({**BEAM, "frequency_penalty": -1}, "frequency_penalty"),
    ({**BEAM, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({**BEAM, "logprobs": 0}, "logprobs"),
    ({**BEAM, "n": 5}, "n"), ({**BEAM, "best_of": 4}, "best_of"),
    # and without beam search, the beam fields are refused rather than ignored
    ({"beam_width": 4}, "beam_width"), ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_refused_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_dict(fields)
    assert info.value.param == param and str(info.value).startswith(param), str(info.value)
    assert info.value.status == 400 and len(str(info.value)) <= 300


ACCEPTED: list[dict[str, Any]] = [
    {"max_tokens": 1}, {"max_tokens": S.MAX_TOKENS}, {"temperature": 0},
    {"temperature": S.MIN_TEMPERATURE},
    {"temperature": S.MAX_TEMPERATURE}, {"top_p": 1e-9}, {"top_p": 1}, {"top_k": 0},
    {"top_k": S.MAX_TOP_K},
    {"min_p": 0}, {"min_p": 1}, {"seed": S.SEED_RANGE[0]}, {"seed": S.SEED_RANGE[1]},
    {"seed": None},
    {"min_tokens": 16, "max_tokens": 16}, {"presence_penalty": -2}, {"frequency_penalty": 2},
    {"repetition_penalty": S.REPETITION_PENALTY_RANGE[0]},
    {"repetition_penalty": S.REPETITION_PENALTY_RANGE[1]},
    {"stop": "x" * S.MAX_STOP_LEN}, {"stop": ["a"] * S.MAX_STOP},
    {"stop_token_ids": [0, S.MAX_TOKEN_ID]},
    {"stop_token_ids": list(range(S.MAX_STOP_TOKEN_IDS))}, {"logit_bias": {"0": -100, "7": 100.0}},
    {"logit_bias": [[3, 1.5]]}, {"logit_bias": {str(i): 1
                                                for i in range(S.MAX_LOGIT_BIAS_ENTRIES)}},
    {"logprobs": 0}, {"logprobs": S.MAX_LOGPROBS}, {"n": S.MAX_N, "best_of": S.MAX_N},
    {"ignore_eos": True},
    {**BEAM, "length_penalty": S.LENGTH_PENALTY_RANGE[0]},
    {**BEAM, "length_penalty": S.LENGTH_PENALTY_RANGE[1]},
    {**BEAM, "temperature": 0.0}, {**BEAM, "temperature": 1},
    {**BEAM, "n": 4, "early_stopping": "never"},
    {**BEAM, "seed": 3, "min_tokens": 2, "stop_token_ids": [5]},
    {"beam_width": 1, "length_penalty": 1},
    {"use_beam_search": True, "beam_width": S.MAX_N, "early_stopping": True},
]


@pytest.mark.parametrize("fields", ACCEPTED)
def test_boundary_values_are_accepted_and_cross_the_wire(fields: dict[str, Any]) -> None:
    params = SamplingParams.from_dict(fields)
    # The engine decodes the same record from the wire and validates it again: it must agree.
    add = P.decode(P.encode(P.Add("r", [1], params)))
    assert isinstance(add, P.Add) and add.params == params


def test_length_penalty_range_keeps_beam_scores_finite_and_nonzero() -> None:
    """engine/groups.py divides by gen_len ** length_penalty: finite and > 0 at every accepted
    extreme."""
    lo, hi = S.LENGTH_PENALTY_RANGE
    for gen_len in (1, 2, S.MAX_TOKENS):
        for lp in (lo, hi):
            denom = gen_len ** lp
            assert math.isfinite(denom) and denom > 0 and math.isfinite(-1e6 / denom)


def test_unknown_sampling_field_is_named() -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_dict({"temperature": 0.5, "temprature": 0.5})
    assert info.value.param == "temprature"


@pytest.mark.parametrize("bad", [True, 1.0, "1", 2**31, -(2**31) - 1, None])
def test_priority_is_checked_by_sdk_and_wire(bad: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        S.check_priority(bad)
    assert info.value.param == "priority"
    payload = (b'{"request_id":"r","prompt_token_ids":[1],"params":{},"priority":'
               + repr(bad).encode() + b"}")
    payload = payload.replace(b"True", b"true").replace(b"None", b"null").replace(b"'", b'"')
    with pytest.raises(ProtocolError, match="priority") as err:
        P.decode([P.MsgType.ADD.value, payload])
    assert err.value.request_id == "r"  # so the engine's ERROR reaches the request's stream


def test_priority_bounds_accepted() -> None:
    assert S.check_priority(S.PRIORITY_RANGE[0]) == S.PRIORITY_RANGE[0]
    assert S.check_priority(S.PRIORITY_RANGE[1]) == S.PRIORITY_RANGE[1]
