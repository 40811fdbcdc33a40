"""Incremental detokenization: token ids in, complete text deltas out, one request at a time.

Decoding all ids every step costs O(length) per token, O(length^2) per request. Instead each step
decodes a short window: the tokens already emitted in the previous chunk (the "prefix", so that
decoders which look at the previous token, such as a Metaspace leading space or a WordPiece "##",
see their context) plus the new ones. The text that the prefix alone decodes to is cut off the
front; the rest is the delta. This is the prefix/read offset scheme of vLLM and mini-sglang.

Two hold-backs:
- A delta that ends in U+FFFD is usually a multi-byte character split across tokens. It is held
  until a later token completes it (or the request ends), so no client ever sees a broken character.
- Text that could still grow into a stop string is held, so a stop string is never emitted, even
  when it is split across tokens. A hit ends the request: text up to, not including, the stop
  string.

Invariant: when no stop string hits, the concatenation of every delta (with `final=True` on the last
step) equals `tokenizer.decode(all_ids, skip_special_tokens=True)`. One exception, by choice: with a
byte-fallback tokenizer (Llama 2 style `<0xE4>` tokens) the full decode turns a whole run of byte
tokens into U+FFFD when the run turns out invalid later, retroactively; matching that would mean
holding every byte run (all CJK text in such vocabularies) until it ends. The stream keeps the valid
characters.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What detokenizing needs of a tokenizer: a transformers tokenizer, or the
    FastDecoder around one."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool = ...) -> str:
        ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        # ids[prefix_offset:read_offset] is the last emitted chunk; ids[read_offset:] not emitted
        # yet.
        self._prefix_offset = 0
        self._read_offset = 0
        # decode(ids[prefix_offset:read_offset]), kept to avoid decoding it twice
        self._prefix_text = ""
        # text decoded so far (emitted or held back); ids[:read_offset] made it
        self.num_decoded_chars = 0
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text held back because it may be the start of a stop string
        self.stopped = False  # a stop string was hit; later tokens are ignored
        self.stop_string: str | None = None  # the stop string that hit (not a finish reason)

    def step(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Add one delta of ids; return the text that is now safe to show. `final=True` flushes
        everything still held (an unfinished character, a stop-string prefix)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        text = self._decode_new(final)
        return self._apply_stop(text, final)

    @property
    def num_decoded_tokens(self) -> int:
        """Tokens whose text is decoded (into num_decoded_chars); later ones end in an
        unfinished character."""
        return self._read_offset

    def _decode_new(self, final: bool) -> str:
        if len(self.token_ids) == self._read_offset:
            return ""
        window = self._decode(self.token_ids[self._prefix_offset :])
        if window.endswith(_REPLACEMENT) and not final:
            return ""  # an unfinished multi-byte character: wait for the bytes that complete it
        delta = window[len(self._prefix_text) :]
        self.num_decoded_chars += len(delta)
        # The chunk just emitted becomes the prefix of the next window; it ends on a complete
        # character, so decoding from read_offset on gives the same text as the full decode.
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special,
                                clean_up_tokenization_spaces=False)

    def _apply_stop(self, text: str, final: bool) -> str:
        if not self._stop:
            return text
        # A match cannot start before the held text: everything that could begin one was held.
        buf = self._held + text
        hit = min(((i, s) for s in self._stop if (i := buf.find(s)) >= 0), default=None)
        if hit is not None:
            self.stopped, self.stop_string, self._held = True, hit[1], ""
            return buf[: hit[0]]
        keep = 0 if final else _stop_prefix_len(buf, self._stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class FastDecoder:
    """The tokenizer's `decode` without transformers' per-call wrapping (about 4x less time
    per call; the gateway decodes once or twice per request per step). Used only where it
    gives the very same text."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend: Tokenizer = tokenizer._tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        assert not clean_up_tokenization_spaces
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def wrap(tokenizer: Decoder) -> Decoder:
        """FastDecoder(tokenizer) when it decodes a probe of ids exactly as
        tokenizer.decode does."""
        backend = getattr(tokenizer, "_tokenizer", None)
        fast_backend = hasattr(backend, "decode") and getattr(tokenizer, "is_fast", False)
        if backend is None or not fast_backend:
            return tokenizer
        fast = FastDecoder(tokenizer)
        specials = list(getattr(tokenizer, "all_special_ids", []))[:8]
        probe = [list(range(0, 300, 7)) + specials, specials + list(range(1000, 1300, 11)), [0], []]
        for ids in probe:
            for skip in (True, False):
                want = tokenizer.decode(ids, skip_special_tokens=skip,
                                        clean_up_tokenization_spaces=False)
                if fast.decode(ids, skip_special_tokens=skip) != want:
                    return tokenizer
        return fast
