"""Chat templates the gateway ships: a Hermes-style ChatML template that knows tools.

SmolLM2's own template (and many ChatML models') renders no tools, no assistant `tool_calls` and no
`role: "tool"` messages. For such a ChatML model a request that uses tools is rendered with
HERMES_CHATML
instead: the tools as JSON inside <tools></tools> in the system turn, each assistant call as a
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` block (the format gateway/tools.py parses
and constrains), and tool results as <tool_response> blocks in a user turn, as Hermes 2 Pro and Qwen
2.5 do. `--chat-template FILE` replaces the template of every request instead.
"""
from __future__ import annotations

import functools
from typing import Any

from shared.errors import InvalidRequest

# Set by the server itself: a request may not override them through chat_template_kwargs.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message", "tokenize", "return_dict", "chat_template",
                      "tokenizer_kwargs", "return_assistant_tokens_mask", "padding", "truncation",
                      "max_length", "return_tensors"})

HERMES_CHATML = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You are a function calling AI model. You are provided with function signatures \
within <tools></tools> XML tags. You may call one or more functions to assist with the user query. \
Don't make assumptions about what values to plug into functions. Here are the available tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags as follows:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role != 'system' %}<|im_start|>system
You are a helpful AI assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not (tools and loop.first) %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": \
{% if call.function.arguments is string %}{{ call.function.arguments }}\
{% else %}{{ call.function.arguments | tojson }}{% endif %}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def template_for(tokenizer: Any, override: str | None, uses_tools: bool) -> str | None:
    """The template a request is rendered with: the --chat-template override; else, for a request
    with tools (or tool messages) on a ChatML model whose template knows no tools, HERMES_CHATML;
    else None (the model's own)."""
    if override is not None:
        return override
    own = getattr(tokenizer, "chat_template", None) or ""
    if uses_tools and isinstance(own, str) and "<|im_start|>" in own and "tool" not in own:
        return HERMES_CHATML
    return None


def template_kwargs(value: Any, tokenizer: Any, template: str | None) -> dict[str, Any]:
    """A request's chat_template_kwargs (e.g. {"enable_thinking": false}) -> the template's extra
    variables. A key the template never reads would be ignored silently: it is a 400 (when the
    template parses with plain Jinja; one using transformers' own tags is not checked)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    read = _variables(source) if isinstance(source, str) else None
    for key in value:
        where = f"chat_template_kwargs.{str(key)[:100]}"
        if key in RESERVED:
            raise InvalidRequest(f"{where}: the server sets it; use the request's own field",
                                 param=where)
        if read is not None and key not in read:
            raise InvalidRequest(f"{where}: the chat template never reads it", param=where)
    return dict(value)


@functools.lru_cache(maxsize=16)
def _variables(source: str) -> frozenset[str] | None:
    """The variables a template reads, or None when plain Jinja cannot parse it."""
    import jinja2
    from jinja2 import meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return None
    return frozenset(meta.find_undeclared_variables(ast))
