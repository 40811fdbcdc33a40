"""The model's tokenizer and chat template, loaded from local files only.

The gateway and the SDK's text calls both use this module, so a prompt is tokenized the same way
whichever door it comes through. Nothing here downloads: `local_files_only=True` everywhere.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from shared.errors import InvalidRequest
from shared.model_source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]
Prompt = str | Messages | list[int]  # text, chat messages, or token ids


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """HF folder: load it directly. GGUF: parse the GGUF metadata once (slow: seconds),
    then keep a saved copy under `cache_dir / "tokenizer"` (default `source.cache_dir`)
    and load that next time."""
    from transformers import AutoTokenizer  # lazy: token-level SDK users never pay for transformers

    tok: PreTrainedTokenizerBase | None
    if source.gguf_file is None:
        tok = AutoTokenizer.from_pretrained(source.folder, local_files_only=True)
    else:
        saved = (cache_dir or source.cache_dir) / "tokenizer"
        tok = _load_saved(saved)
        if tok is None:
            tok = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                                local_files_only=True)
            _save_atomically(tok, saved)
    # The clean-up pass (" ." -> ".") looks across token boundaries, so no incremental detokenizer
    # can reproduce it, and it alters what the model wrote. Turn it off so stream == full decode.
    tok.clean_up_tokenization_spaces = False
    return tok


def _load_saved(folder: Path) -> PreTrainedTokenizerBase | None:
    from transformers import AutoTokenizer

    if not (folder / "tokenizer_config.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # a broken cache is rebuilt, never fatal
        log.warning("cached tokenizer at %s is unreadable (%s); rebuilding it", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _save_atomically(tok: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write into a temp folder and rename, so a second process never sees half a tokenizer."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tokenizer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError as e:  # another process won the race, or the cache is read-only: both fine
        log.info("tokenizer cache not written to %s: %s", folder, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def has_chat_template(tok: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tok, "chat_template", None))


def apply_chat_template(tok: PreTrainedTokenizerBase, messages: Messages,
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, template: str | None = None,
                        kwargs: dict[str, Any] | None = None) -> list[int]:
    """Chat messages -> prompt token ids, with the assistant turn opened for the model to
    continue. tools: OpenAI tool objects for the template; template: Jinja text used instead of
    the model's; kwargs: more variables for the template (a request's chat_template_kwargs,
    checked by the gateway)."""
    if template is None and not has_chat_template(tok):
        raise InvalidRequest("this model has no chat template; use /v1/completions with a plain "
                             "prompt", param="messages")
    try:
        # Any: the return type differs across transformers versions (ids, or a BatchEncoding of
        # them).
        extra: dict[str, Any] = dict(kwargs or {})
        if template is not None:
            extra["chat_template"] = template
        if tools:
            extra["tools"] = tools
        ids: Any = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=True, return_dict=False, **extra)
    except Exception as e:  # templates raise their own errors for bad roles/content
        raise InvalidRequest(f"could not apply the chat template: {e}", param="messages") from None
    # some transformers versions ignore return_dict
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode(tok: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def encode_prompt(tok: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Text is encoded, chat messages go through the chat template, token ids pass as they are."""
    if isinstance(prompt, str):
        return encode(tok, prompt)
    if is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return apply_chat_template(tok, cast("Messages", prompt))
    raise InvalidRequest("prompt must be a string, a list of chat messages or a list of token ids",
                         param="prompt")


def decode(tok: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one flat list of ids decodes to one string
    return text
