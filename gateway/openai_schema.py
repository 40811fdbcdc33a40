"""OpenAI request bodies -> (prompt ids, SamplingParams); the response/chunk objects back are
gateway/openai_output.py's.

Everything a client can get wrong is checked here, before the engine sees the request, and answered
with a 400 in OpenAI's error shape; the engine re-checks only what protects itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, overload

from gateway.reasoning import Reasoning, parse_reasoning
from gateway.request_fields import check_fields, check_stream_options
from gateway.structured import constraint_of
from gateway.templates import template_for, template_kwargs
from gateway.tools import Tools, parse_tools
from shared.constraints import Constraint
from shared.errors import InvalidRequest
from shared.sampling import MAX_LOGPROBS, MAX_N, MAX_TOKENS, SamplingParams, check_priority
from shared.tokenizer import apply_chat_template

# OpenAI / vLLM field -> SamplingParams field, passed through as given (SamplingParams validates).
_PASSTHROUGH = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed",
                                        "stop_token_ids", "ignore_eos", "min_tokens",
                                        "presence_penalty", "frequency_penalty",
                                        "repetition_penalty", "logit_bias", "speculative",
                                        "cache_salt")}
# Refused unless at their neutral values: never silently ignored.
_REFUSED = {"suffix": ("", "suffix (text after the insertion point) is not supported")}


@dataclass(slots=True)
class Served:
    """What the gateway serves, learned from the engine's READY at start-up."""

    name: str = ""
    max_model_len: int = 0
    tokenizer: Any = None
    chat_template: str | None = None  # --chat-template: rendered instead of the model's template
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None  # --reasoning-parser (gateway/reasoning.py)
    # with a parser: `</think>`'s spellings in context (gateway/reasoning.py spellings)
    reasoning_end_spellings: tuple[tuple[int, ...], ...] = ()
    max_prompt_chars: int = 0  # 0: no limit (GatewayConfig.max_prompt_chars says how it is set)

    def check_chars(self, n: int, param: str) -> None:
        """Before tokenizing: text this long cannot fit the context, and tokenizing it takes
        seconds."""
        if self.max_prompt_chars and n > self.max_prompt_chars:
            raise InvalidRequest(f"the {param} has {n} characters; at most {self.max_prompt_chars} "
                                 f"fit this model's context of {self.max_model_len} tokens "
                                 "(--max-prompt-chars)", param=param)


@dataclass(slots=True)
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int = 0  # vLLM's extra field: lower is served first
    tools: Tools | None = None  # a chat request with tools (and tool_choice not "none")
    reasoning: Reasoning | None = None  # a chat request to a server with --reasoning-parser
    # Scoring (gateway/completions.py): the prompt text echoed before each choice's text
    # (completions' echo), vLLM's prompt_logprobs (alternatives per prompt token in the response),
    # and max_tokens 0 (the engine samples one token, which the response leaves out).
    echo: str | None = None
    prompt_logprobs: int | None = None
    score_only: bool = False
    # Under --cache-isolation per-key: the tenant salt of the request's API key (gateway/auth.py),
    # which the door copies from the HTTP request; run_request salts the prefix cache with it.
    tenant: str | None = None


def parse_chat(body: Any, served: Served) -> ParsedRequest:
    body = _check_common(body, served, chat=True)
    tools = parse_tools(body, served.tool_call_parser)
    messages = parse_messages(body.get("messages"))
    served.check_chars(sum(len(m["content"]) for m in messages), "messages")
    uses_tools = tools is not None or any(m["role"] == "tool" or m.get("tool_calls")
                                          for m in messages)
    template = template_for(served.tokenizer, served.chat_template, uses_tools)
    kwargs = template_kwargs(body.get("chat_template_kwargs"), served.tokenizer, template)
    ids = apply_chat_template(served.tokenizer, messages, tools=tools.tools if tools else None,
                              template=template, kwargs=kwargs)
    given = {key: _int_field(body, key, None, 1, MAX_TOKENS)
             for key in ("max_completion_tokens", "max_tokens")}
    # both type-checked, the newer name wins
    max_tokens = given["max_completion_tokens"] or given["max_tokens"]
    if max_tokens is not None:
        body = {**body, "max_tokens": max_tokens}
    # the default: the rest of the context
    rest = min(MAX_TOKENS, max(1, served.max_model_len - len(ids)))
    parsed = _finish(body, ids, served, "messages", default_max_tokens=rest, chat=True,
                     tool_constraint=tools.constraint() if tools else None)
    parsed.tools = tools
    parsed.reasoning, parsed.params = parse_reasoning(body, served.reasoning_parser,
                                                      served.tokenizer, ids, parsed.params,
                                                      served.reasoning_end_spellings)
    return with_prompt_logprobs(parsed, body)


def with_prompt_logprobs(parsed: ParsedRequest, body: dict[str, Any],
                         echo_k: int | None = None) -> ParsedRequest:
    """vLLM's prompt_logprobs field (and completions' echo with logprobs, echo_k): the engine scores
    the prompt with the larger of the two numbers of alternatives; each view keeps its own."""
    k = _int_field(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if k is not None and parsed.stream:
        raise InvalidRequest("prompt_logprobs are not available with stream=true",
                             param="prompt_logprobs")
    if parsed.params.use_beam_search and (k is not None or echo_k is not None):
        raise InvalidRequest("prompt logprobs are not returned with beam search",
                             param="prompt_logprobs")
    wanted = [x for x in (k, echo_k) if x is not None]
    if wanted:
        parsed.params = dataclasses.replace(parsed.params, prompt_logprobs=max(wanted))
    parsed.prompt_logprobs = k
    return parsed


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages; content given as a list of text parts is joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'",
                                 param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                     param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        out.append({**m, "content": content})
    return out


def _check_common(body: Any, served: Served, chat: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    if model is not None and model != served.name:
        raise InvalidRequest(f"The model `{model}` does not exist. This server serves "
                             f"`{served.name}`.", param="model", code="model_not_found")
    for key, (neutral, why) in _REFUSED.items():
        value = body.get(key)
        if value is not None and not (type(value) is type(neutral) and value == neutral):
            raise InvalidRequest(f"{key}={_show(value)}: {why}", param=key)
    return body


def _finish(body: dict[str, Any], ids: list[int], served: Served, what: str,
            default_max_tokens: int, chat: bool,
            tool_constraint: Constraint | None = None) -> ParsedRequest:
    vocab = len(served.tokenizer)
    if not ids:
        raise InvalidRequest(f"the {what} is empty after tokenization", param=what)
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param=what)
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {_show(stream)}", param="stream")
    include_usage = check_stream_options(body.get("stream_options"))
    priority = body.get("priority")
    priority = 0 if priority is None else check_priority(priority)
    fields = {dst: body[src] for src, dst in _PASSTHROUGH.items() if body.get(src) is not None}
    if type(fields.get("top_k")) is int and fields["top_k"] == -1:
        fields["top_k"] = 0  # vLLM's spelling of "off"
    max_tokens = body.get("max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    stop = body.get("stop")
    stop = [] if stop is None else stop
    fields |= _sequence_fields(body, chat, stream)
    constraint = constraint_of(body)
    if tool_constraint is not None and constraint is not None:
        raise InvalidRequest("tool_choice required or a named function cannot be combined with "
                             "response_format or another structured-output constraint",
                             param="tool_choice")
    if (constraint := tool_constraint or constraint) is not None:
        fields["constraint"] = constraint
    params = SamplingParams.from_dict({**fields, "max_tokens": max_tokens, "stop": stop})
    max_tokens = params.max_tokens  # validated now
    if len(ids) + max_tokens > served.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {served.max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} in "
            f"the completion). Please reduce the length of the {what} or completion.",
            param=what, code="context_length_exceeded")
    return ParsedRequest(ids, params, stream, include_usage, priority)


def _sequence_fields(body: dict[str, Any], chat: bool, stream: bool) -> dict[str, Any]:
    """n, best_of, logprobs and beam search, as OpenAI (and vLLM's extras) spell them ->
    SamplingParams fields."""
    n = _int_field(body, "n", 1, 1, MAX_N)
    best_of = _int_field(body, "best_of", None, 1, MAX_N)
    if chat and best_of is not None:
        raise InvalidRequest("best_of is a /v1/completions parameter; chat completions take n",
                             param="best_of")
    if best_of is not None and best_of < n:
        raise InvalidRequest(f"best_of must be >= n, got best_of={best_of} and n={n}",
                             param="best_of")
    out: dict[str, Any] = {"n": n, "logprobs": _logprobs_field(body, chat)}
    beam = body.get("use_beam_search")
    if beam is not None and not isinstance(beam, bool):
        raise InvalidRequest(f"use_beam_search must be true or false, got {_show(beam)}",
                             param="use_beam_search")
    if beam:  # vLLM's spelling, where best_of was the beam width
        # the engine returns beam search's tokens and finish reasons only
        if out["logprobs"] is not None:
            raise InvalidRequest("logprobs are not returned for beam search outputs",
                                 param="logprobs")
        out |= {"use_beam_search": True,
                "beam_width": _int_field(body, "beam_width", best_of or n, 1, MAX_N)}
        return out | {k: body[k] for k in ("length_penalty", "early_stopping")
                      if body.get(k) is not None}
    # SamplingParams type-checks these and refuses any but their neutral values without beam search
    out |= {k: body[k] for k in ("beam_width", "length_penalty", "early_stopping")
            if body.get(k) is not None}
    if best_of is not None:
        if stream and best_of > n:
            raise InvalidRequest("best_of > n cannot stream: which sequences are best is known "
                                 "only at the end; set stream=false or best_of=n", param="best_of")
        out["best_of"] = best_of
    return out


def _logprobs_field(body: dict[str, Any], chat: bool) -> int | None:
    """Completions take `logprobs: int`; chat takes `logprobs: bool` and `top_logprobs: int`. -> how
    many alternatives per token the engine reports (None: no logprobs at all)."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise InvalidRequest("top_logprobs is a chat parameter; /v1/completions takes "
                                 "logprobs=<number of alternatives>", param="top_logprobs")
        return _int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest(f"logprobs must be true or false, got {_show(wanted)} (top_logprobs "
                             "sets how many alternatives)", param="logprobs")
    top = _int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and wanted is not True:
        raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    return (top or 0) if wanted else None


@overload
def _int_field(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int: ...
@overload
def _int_field(body: dict[str, Any], key: str, default: None, lo: int, hi: int) -> int | None: ...
def _int_field(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequest(f"{key} must be an integer in [{lo}, {hi}], got {_show(value)}",
                             param=key)
    return value


def _show(value: Any) -> str:
    """A value in an error message, cut short: a client's megabyte string does not come back
    whole."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
