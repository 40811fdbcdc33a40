"""shared/choices.py without sockets: engine rows in, each choice's text and logprobs out."""
from __future__ import annotations

from shared.choices import Choices, TokenStrings
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.fakes import fake_logprobs, smollm2_tokenizer


def test_a_row_without_tokens_flushes_held_text_with_its_logprobs() -> None:
    """An abort ends a choice with a row of no new tokens. With logprobs on, the text still held
    back (here the start of a possible stop string) goes out as text, its tokens' entries with
    it."""
    tok = smollm2_tokenizer()
    ids = tok.encode(" The capital of France")
    params = SamplingParams(max_tokens=50, logprobs=0, stop=(" France is",))
    choices = Choices("r", 3, params, tok, TokenStrings(tok))
    lps = [fake_logprobs(t, i, 1) for i, t in enumerate(ids)]
    first = choices.feed(RequestOutput("r", ids, logprobs=lps))
    last = choices.feed(RequestOutput("r", [], True, "abort"))
    assert [o.text for o in first] == [" The capital of"]  # " France" may still become " France is"
    assert [o.text for o in last] == [" France"]
    tokens = [e.token for o in first + last for e in o.logprobs or []]
    assert tokens == [tok.decode([t]) for t in ids]
    assert [e.token for e in last[0].logprobs or []] == [" France"]
    assert last[0].finished and last[0].finish_reason == "abort" and last[0].token_ids == []
