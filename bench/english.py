"""Real English prompts, offline: passages of the Python standard library's docstrings in the chat
template.

Random token ids (bench/common.py workload) make a fine load for GEMMs, but a served comparison
should send what users send: prose through the chat template. The standard library's docstrings are
English, on every machine, and the same for one Python version, so a seed gives the same prompts
everywhere.
"""
from __future__ import annotations

import ast
import inspect
import random
import sysconfig
from pathlib import Path
from typing import Any

_MIN_DOC = 200  # characters: shorter docstrings are mostly signatures and one-liners


def corpus(max_chars: int = 1_500_000) -> str:
    """The docstrings (module, class, function) of the stdlib's top-level modules, in file-name
    order."""
    docs: list[str] = []
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc) >= _MIN_DOC:
                    docs.append(inspect.cleandoc(doc))
                    size += len(docs[-1])
        if size >= max_chars:
            break
    return "\n\n".join(docs)


def chat_prompts(tok: Any, num: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int = 0) -> list[tuple[list[int], int]]:
    """Seeded (prompt token ids, output length) pairs. Each prompt is one user turn in the model's
    chat template (its default system turn included) holding a passage of the corpus, cut so the
    whole prompt has the drawn length: the passage is drawn in tokens, decoded and templated, and
    its length corrected while the text round trip moves the count (rarely off by a token or two in
    the end)."""
    from shared.tokenizer import apply_chat_template

    ids = tok.encode(corpus(), add_special_tokens=False)
    overhead = len(apply_chat_template(tok, [{"role": "user", "content": ""}]))
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        target, n_out = rng.randint(*prompt_range), rng.randint(*output_range)
        start = rng.randrange(0, len(ids) - prompt_range[1])
        body = max(1, target - overhead)
        # a few corrections; a passage whose count keeps jumping is taken as it is
        for _ in range(8):
            prompt = apply_chat_template(tok,
                                         [{"role": "user",
                                           "content": tok.decode(ids[start:start + body])}])
            if len(prompt) == target or (body == 1 and len(prompt) > target):
                break
            body = max(1, body + target - len(prompt))
        out.append((prompt, n_out))
    return out
