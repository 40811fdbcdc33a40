"""xgrammar against llguidance on this model's vocabulary: the measurement that chose the grammar
engine.

Per library: preparing the tokenizer (once per process), compiling a typical JSON schema, and
filling the next-token bitmasks of 32 matchers per step along a 37-token output; then applying a
[32, V] bitmask to the logits three ways. llguidance is not a dependency: `pip install
llguidance==1.9.1` to run this.

    python bench/grammar_engines.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
TEXT = ('{"name": "Bob the builder of very long names", "age": 42, '
        '"tags": ["x y z", "hello world"], "kind": "a"}')
B = 32


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main() -> None:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    vocab = len(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    schema = json.dumps(SCHEMA)
    print(f"# {machine()}\n# vocabulary {vocab}, batch {B}, {len(ids)} tokens per output")

    import xgrammar as xgr
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    prep = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    grammar = compiler.compile_json_schema(schema)
    comp = time.perf_counter() - t
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(B)]
    bitmask = xgr.allocate_token_bitmask(B, vocab)
    fill = 0.0
    for token in ids:
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        fill += time.perf_counter() - t
        assert all(m.accept_token(token) for m in matchers)
    print(f"xgrammar:   tokenizer {ms(prep)}, compile {ms(comp)}, fill {ms(fill / len(ids))} per "
          "step")

    try:
        import llguidance
    except ImportError:
        sys.exit("llguidance is not installed (not a dependency): pip install llguidance==1.9.1")
    import llguidance.hf
    import llguidance.torch as lt
    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    prep = time.perf_counter() - t
    t = time.perf_counter()
    grm = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llguidance.LLMatcher(lltok, grm)
    comp = time.perf_counter() - t
    lms = [llguidance.LLMatcher(lltok, grm) for _ in range(B)]
    lbits = lt.allocate_token_bitmask(B, vocab)
    fill = 0.0
    for token in ids:
        t = time.perf_counter()
        for i, m in enumerate(lms):
            lt.fill_next_token_bitmask(m, lbits, i)
        fill += time.perf_counter() - t
        assert all(m.consume_token(token) for m in lms)
    print(f"llguidance: tokenizer {ms(prep)}, compile+matcher {ms(comp)}, fill "
          f"{ms(fill / len(ids))} per step")

    logits = torch.randn(B, vocab)
    # the worst case for branches
    random_bits = torch.randint(-2**31, 2**31 - 1, bitmask.shape, dtype=torch.int32)

    def ours() -> None:
        bits = np.unpackbits(random_bits.numpy().view(np.uint8), axis=-1,
                             bitorder="little")[:, :vocab]
        masked = (bits.astype(np.int32) - 1) & np.int32(-8388608)
        logits.add_(torch.from_numpy(masked.view(np.float32)))

    ways = (("xgrammar apply_token_bitmask_inplace",
             lambda: xgr.apply_token_bitmask_inplace(logits, random_bits)),
            ("llguidance.torch apply_token_bitmask_inplace",
             lambda: lt.apply_token_bitmask_inplace(logits, random_bits)),
            ("engine/structured.py (unpack, add -inf)", ours))
    for name, fn in ways:
        fn()
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 0.5 or n < 2:
            fn()
            n += 1
        print(f"apply [{B}, {vocab}] {name}: {ms((time.perf_counter() - t) / n)}")


if __name__ == "__main__":
    main()
