"""Structured output in the engine: outputs checked by references nobody here wrote (the
`jsonschema` package, Python's `re.fullmatch`, membership, a recursive-descent parse), with the real
SmolLM2 for the schemas and a tiny random model (SmolLM2's tokenizer) where the claim holds for any
weights: preemption, n > 1, speculative decoding, compile errors."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.offline import LLM
from shared.constraints import Constraint, choice, json_schema
from shared.errors import InvalidRequest
from shared.protocol import Error
from shared.sampling import SamplingParams
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow

# bounded strings and integers keep outputs short under max_tokens: an unbounded integer let one
# sampled row write digits until max_tokens (finish reason "length") once the arithmetic moved a bit
S = {"type": "string", "maxLength": 12}
N = {"type": "integer", "minimum": -1000, "maximum": 1000}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
     "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object",
                                                 "properties": {"first": S, "last": S},
                                                 "required": ["first", "last"],
                                                 "additionalProperties": False}},
     "required": ["person"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["id"]},
    {"type": "object", "properties": {"v": {"anyOf": [N, {"type": "null"}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"},
                                      "y": {"type": "integer"}},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                           "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}},
     "required": ["date"]},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
     "required": ["ip"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": S},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": S},
     "required": ["level"]},
    {"type": "object",
     "properties": {"m": {"type": "object",
                          "properties": {"k": {"type": "array", "maxItems": 2,
                                               "items": {"type": "boolean"}}},
                          "required": ["k"]}},
     "required": ["m"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["p"]},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 10}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "array", "items": False,
                                                "prefixItems": [{"type": "integer"},
                                                                {"type": "integer"}]}},
     "required": ["point"]},
]
REGEX = r"[A-Z][a-z]{2,5}-\d{3}"
CHOICES = ["positive", "negative", "neutral"]
# Arithmetic over small integers: the test parses the output with a recursive-descent
# parser of its own.
# bounded (at most 47 characters), so the grammar ends every sentence within max_tokens: a stop
# that does not hang on whether the model's weights choose to close the expression
ARITH = ('root ::= expr\nexpr ::= term (("+" | "-") term)? (("+" | "-") term)?\n'
         'term ::= factor (("*" | "/") factor)?\n'
         'factor ::= num | "(" num (("+" | "-") num)? ")"\nnum ::= [1-9] [0-9]?')


def parses_as_arithmetic(text: str) -> bool:
    pos = 0

    def expr() -> None:
        term()
        while peek() in ("+", "-"):
            eat()
            term()

    def term() -> None:
        factor()
        while peek() in ("*", "/"):
            eat()
            factor()

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            eat()
            expr()
            assert eat() == ")"
            return
        m = re.match(r"[1-9][0-9]?", text[pos:])
        assert m
        pos += m.end()

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def eat() -> str:
        nonlocal pos
        pos += 1
        return text[pos - 1]

    try:
        expr()
    except AssertionError:
        return False
    return pos == len(text)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    import torch

    torch.set_num_threads(1)
    return LLM("SmolLM2-135M-Instruct", dtype="float32", num_threads=1, kv_cache_memory="192MiB")


@pytest.fixture(scope="module")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, make_tiny_checkpoint) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.e2e.conftest import TINY_CHAT

    folder = tmp_path_factory.mktemp("models") / "tiny-chat"
    make_tiny_checkpoint(folder, LlamaConfig, LlamaForCausalLM, seed=3, **TINY_CHAT)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def validates(schema: dict[str, Any]) -> Callable[[str], bool]:
    return lambda text: jsonschema.validate(json.loads(text), schema) is None


def texts(llm: LLM, prompts: list[list[int]],
          params: list[SamplingParams]) -> list[tuple[str, str | None]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    tok = llm.tokenizer
    return [(str(tok.decode(s.token_ids, skip_special_tokens=True)), s.finish_reason) for o in outs
            for s in o.outputs]


def test_smollm2_outputs_match_schemas_regex_choice_and_grammar(smollm2: LLM) -> None:
    """One batch: every schema greedy and sampled, plus a regex, a choice and an EBNF
    grammar each way."""
    tok = smollm2.tokenizer
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    checks: list[Callable[[str], bool]] = []
    for i, schema in enumerate(SCHEMAS):
        prompt = chat(tok, f"Fill in: {' '.join(schema.get('properties', {})) or schema['type']}")
        for p in (SamplingParams(temperature=0, max_tokens=48, constraint=json_schema(schema)),
                  SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                                 constraint=json_schema(schema))):
            prompts.append(prompt)
            params.append(p)
            checks.append(validates(schema))
    others = [("Make up a product code.", Constraint("regex", REGEX),
               lambda t: re.fullmatch(REGEX, t) is not None, 24),
              ("Is 'I love it' positive?", choice(CHOICES), lambda t: t in CHOICES, 24),
              ("Write an arithmetic expression.", Constraint("grammar", ARITH),
               parses_as_arithmetic, 48)]
    for i, (question, c, check, most) in enumerate(others):
        for p in (SamplingParams(temperature=0, max_tokens=most, constraint=c),
                  SamplingParams(temperature=1.0, seed=100 + i, max_tokens=most, constraint=c)):
            prompts.append(chat(tok, question))
            params.append(p)
            checks.append(check)
    results = texts(smollm2, prompts, params)
    for (text, reason), check, p in zip(results, checks, params):
        assert reason == "stop", (text, p.constraint)
        assert check(text), (text, p.constraint)
    # greedy and sampled share one compile
    assert smollm2.core.grammars.stats["grammar_cache_hits"] >= len(SCHEMAS)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(smollm2: LLM) -> None:
    tok = smollm2.tokenizer
    free = [chat(tok, "Tell me about cats."), chat(tok, "What is 2 + 2?")]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = texts(smollm2, free, [greedy, greedy])
    c = SamplingParams(temperature=0, max_tokens=16, constraint=json_schema(SCHEMAS[0]))
    mixed = texts(smollm2, [free[0], chat(tok, "JSON please"), free[1], chat(tok, "more JSON")],
                  [greedy, c, greedy, c])
    assert [mixed[0], mixed[2]] == alone


def tiny_llm(folder: Path, **options: object) -> LLM:
    return LLM(str(folder), num_threads=1,
               **({"kv_cache_memory": "16MiB", "swap_space": "16MiB"} | options))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_n4_keep_the_grammar(tiny_chat_model_dir: Path, mode: str) -> None:
    """A pool too small for every request at once preempts; forks (n=4) each keep their
    own matcher."""
    llm = tiny_llm(tiny_chat_model_dir, num_blocks=12, block_size=4, num_cpu_blocks=64,
                   preemption_mode=mode, max_num_batched_tokens=64)
    schema = SCHEMAS[11]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, n=4 if i == 0 else 1,
                             constraint=json_schema(schema)) for i in range(4)]
    prompts = [[1, 5 + i, 7, 9] for i in range(4)]
    results = texts(llm, prompts, params)
    assert len(results) == 7
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert llm.core.scheduler.num_preemptions[mode] > 0
    bm = llm.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks


def test_constrained_requests_do_not_speculate(tiny_chat_model_dir: Path) -> None:
    """With an n-gram proposer running, a constrained request takes the plain path (no draft is ever
    verified for it) and gives what it gives without speculation."""
    c = SamplingParams(temperature=0, max_tokens=40,
                       constraint=Constraint("regex", "(ab|cd){3,8}x"))
    prompt = [[1, 97, 98, 97, 98, 97, 98, 97, 98]]
    plain = texts(tiny_llm(tiny_chat_model_dir), prompt, [c])
    spec = tiny_llm(tiny_chat_model_dir, speculative="ngram", num_speculative_tokens=3)
    assert texts(spec, prompt, [c]) == plain
    assert re.fullmatch("(ab|cd){3,8}x", plain[0][0])
    assert spec.core.scheduler.spec_stats["spec_verifications"] == 0


@pytest.mark.parametrize(("constraint", "words"), [
    (Constraint("json", '{"type": "object", "properties": 5}'), "properties must be an object"),
    (Constraint("regex", "a(b"), "parenthesis is not closed"),
    (Constraint("grammar", "root ::= foo"), 'Rule "foo" is not defined'),
])
def test_a_constraint_that_does_not_compile_is_a_400_and_the_engine_goes_on(
        tiny_chat_model_dir: Path, constraint: Constraint, words: str) -> None:
    llm = tiny_llm(tiny_chat_model_dir)
    core = llm.core
    core.add("bad", [1, 5, 7], SamplingParams(max_tokens=4, constraint=constraint))
    core.add("good", [1, 5, 7], SamplingParams(max_tokens=4, temperature=0))
    # bad waits apart
    assert not core.scheduler.waiting or core.scheduler.waiting[0].request.request_id == "good"
    errors: list[Error] = []
    finished = set()
    while core.has_work():
        for out in core.step():
            if isinstance(out, Error):
                errors.append(out)
            elif out.finished:
                finished.add(out.request_id)
    assert [(e.request_id, e.status)
            for e in errors] == [("bad", 400)] and words in errors[0].message
    assert finished == {"good"} and "bad" not in core.requests


def test_sampling_params_refuse_what_a_constraint_cannot_honour() -> None:
    c = Constraint("regex", "a+")
    bads: list[dict[str, Any]] = [{"use_beam_search": True, "beam_width": 2, "temperature": 0},
                                  {"min_tokens": 2}]
    for bad in bads:
        with pytest.raises(InvalidRequest):
            SamplingParams(constraint=c, **bad)
    with pytest.raises(InvalidRequest):
        Constraint("choice", "[]")
    with pytest.raises(InvalidRequest):
        Constraint("xml", "<a/>")
    p = SamplingParams(constraint=c)
    # what the wire carries
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_apply_masks_sets_exactly_the_disallowed_tokens_to_minus_inf() -> None:
    """Against a plain torch.where over random masks, with an unconstrained row left as it was."""
    import numpy as np
    import torch

    from engine.structured import apply_masks

    class Row:
        def __init__(self, bits: torch.Tensor | None) -> None:
            self.matcher = self if bits is not None else None
            self.bits = bits

        def fill_next_token_bitmask(self, bitmask: torch.Tensor, j: int) -> None:
            assert self.bits is not None
            bitmask[j] = self.bits

    vocab, words = 100, 4  # 100 tokens in 4 int32 words, the last one partly padding
    allowed = np.random.default_rng(0).random((3, words * 32)) < 0.3
    packed = [torch.from_numpy(np.packbits(a.reshape(-1, 8), axis=1,
                                           bitorder="little").reshape(-1).view(np.int32))
              for a in allowed]
    seqs = [Row(packed[0]), Row(None), Row(packed[1]), Row(packed[2])]
    logits = torch.randn(4, vocab)
    before = logits.clone()
    apply_masks(logits, seqs)  # type: ignore[arg-type]
    assert torch.equal(logits[1], before[1])
    for i, r in ((0, 0), (2, 1), (3, 2)):
        assert torch.equal(logits[i], torch.where(torch.from_numpy(allowed[r, :vocab]), before[i],
                                                  float("-inf")))
