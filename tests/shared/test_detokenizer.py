"""IncrementalDetokenizer: the stream equals the full decode, characters are never split, stop
strings are never emitted, and each step decodes a bounded window."""
from __future__ import annotations

import functools
import json
import random
from typing import Any

import pytest

from shared.detokenizer import IncrementalDetokenizer
from tests.fakes import smollm2_tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "Emoji: 😀🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin 👍🏽 done.",
    ("Mixed: café naïve Ωμέγα Привет مرحبا 日本語テキスト ✓ → ∑ 🚀\n\n"
     "def f(x):\n    return x ** 2\n"),
]


@functools.lru_cache(maxsize=1)
def byte_fallback_tokenizer() -> Any:
    """A Llama-2 style tokenizer (Metaspace "▁", byte fallback, leading-space strip) built offline:
    a different decoder family from SmolLM2's byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE())
    base.normalizer = norm
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    base.train_from_iterator(TEXTS[:1] * 10 + ["hello there world, tokenizers are fun"] * 10,
                             trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    hf.clean_up_tokenization_spaces = False
    return hf


TOKENIZERS = {"smollm2": smollm2_tokenizer, "byte_fallback": byte_fallback_tokenizer}


class CountingTokenizer:
    """Records how many ids each decode call gets, to check the per-step work bound."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.sizes = tok, list[int]()

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def stream(tok: Any, ids: list[int], rng: random.Random, stop: tuple[str, ...] = (),
           max_chunk: int = 3) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids in random-size deltas, the last one with final=True, as the engine's steps would."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(detok.step(ids[i : i + n], final=i + n >= len(ids)))
        i += n
    return deltas, detok


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stream_equals_full_decode_on_texts(name: str) -> None:
    tok, rng = TOKENIZERS[name](), random.Random(1)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ids.insert(len(ids) // 2, tok.eos_token_id)  # special tokens are skipped, in the stream too
        for _ in range(5):
            deltas, _ = stream(tok, ids, rng)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
            assert all("\ufffd" not in d for d in deltas), "a multi-byte character was split"


def test_stream_equals_full_decode_on_random_ids() -> None:
    """Byte-level BPE: any ids, invalid UTF-8 included."""
    tok, rng = smollm2_tokenizer(), random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        deltas, _ = stream(tok, ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids


def test_byte_fallback_random_ids_with_valid_utf8() -> None:
    """Byte fallback: random tokens mixed with whole characters spelled as <0xXX> tokens. (Invalid
    byte runs are out of scope: the full decode turns a whole run into U+FFFD after the fact.)"""
    tok, rng = byte_fallback_tokenizer(), random.Random(2)
    byte_id = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    normal = [i for i in range(len(tok)) if not tok.convert_ids_to_tokens(i).startswith("<0x")]
    chars = "".join(TEXTS)
    for _ in range(300):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 40):
            ids += ([rng.choice(normal)] if rng.random() < 0.5
                    else [byte_id[b] for b in rng.choice(chars).encode()])
        deltas, _ = stream(tok, ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_per_step_work_is_bounded(name: str) -> None:
    """Decoding 2000+ tokens one at a time never decodes more than a small window per call."""
    tok = CountingTokenizer(TOKENIZERS[name]())
    ids = tok.tok.encode("".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 1000
    deltas, _ = stream(tok, ids, random.Random(3), max_chunk=1)
    assert "".join(deltas) == tok.tok.decode(ids, skip_special_tokens=True)
    assert max(tok.sizes) <= 12  # an emoji is at most 4 byte tokens; window = last chunk + pending
    assert len(tok.sizes) <= 2 * len(ids)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text, stop, expected", [
    ("Hello world! The end.", ("o w",), "Hell"),
    ("Hello world! The end.", ("The", "world"), "Hello "),  # the earliest match wins
    ("你好，世界。今天天气很好", ("世界",), "你好，"),
    ("你好，世界。今天天气很好", ("界。今",), "你好，世"),
    ("Emoji 😀🎉 party", ("🎉",), "Emoji 😀"),
    # "Hel" held, then released as "Help"
    ("Help is here, Hello there", ("Hello",), "Help is here, "),
])
def test_stop_string_split_across_tokens(name: str, text: str, stop: tuple[str, ...],
                                         expected: str) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode(text, add_special_tokens=False)
    for seed in range(5):
        deltas, detok = stream(tok, ids, random.Random(seed), stop)
        assert "".join(deltas) == expected
        assert detok.stopped and detok.stop_string in stop
        # nothing after a stop
        assert detok.step(tok.encode(" more", add_special_tokens=False)) == ""


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_prefix_is_held_then_flushed_when_no_hit(name: str) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode("answer: 42\n", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("\n\n",))
    deltas = [detok.step([t]) for t in ids]
    assert not "".join(deltas).endswith("\n")  # "\n" could still become "\n\n"
    assert "".join(deltas) + detok.step([], final=True) == "answer: 42\n" and not detok.stopped


def test_stop_strings_on_random_ids_never_leak() -> None:
    tok, rng = smollm2_tokenizer(), random.Random(4)
    ids_pool = tok.encode("".join(TEXTS), add_special_tokens=False)
    for _ in range(200):
        start = rng.randrange(len(ids_pool) - 30)
        ids = ids_pool[start : start + 30]
        full = tok.decode(ids, skip_special_tokens=True)
        a = rng.randrange(len(full))
        stop = full[a : a + rng.randint(1, 4)]
        if "\ufffd" in stop:
            continue
        deltas, detok = stream(tok, ids, rng, (stop,))
        assert "".join(deltas) == full[: full.find(stop)] and detok.stopped
