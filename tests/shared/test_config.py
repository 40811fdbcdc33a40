"""Each engine option has one home: a flat option reaches the config class that owns it, and no name
is owned twice (a name in two classes reached only the first, the other silently kept its
default)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

import shared.config as C


def test_max_model_len_lands_on_the_engine_config() -> None:
    config = C.build_config("m", max_model_len=48, max_num_seqs=3, block_size=8)
    assert config.max_model_len == 48
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == 8
    assert not hasattr(config.scheduler, "max_model_len")


def test_unknown_and_nested_names_are_refused() -> None:
    for name in ("no_such_option", "scheduler", "cache"):
        with pytest.raises(TypeError, match="unknown engine option"):
            C.build_config("m", **{name: 1})
    assert C.build_config("m", speculative="ngram").speculative.speculative == "ngram"


def test_a_name_owned_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclass(frozen=True)
    class Twice(C.CacheConfig):
        max_num_seqs: int = 1

    monkeypatch.setattr(C, "CacheConfig", Twice)
    with pytest.raises(TypeError,
                       match="'max_num_seqs' is owned by both SchedulerConfig and Twice"):
        C.check_one_owner()


def test_bad_max_model_len_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        C.build_config("m", max_model_len=1)


def test_engine_flags_travel_to_the_engine_process_as_given() -> None:
    """`conveyor serve` hands its engine flags to `python -m engine`: switches travel as bare flags
    (`--deterministic True` was once refused there), values as flag and value, and both parse
    back."""
    import argparse

    from shared.engine_args import add_engine_args, engine_argv

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    given = ["--deterministic", "--no-prefix-caching", "--max-model-len", "48"]
    argv = engine_argv(parser.parse_args(given))
    assert sorted(argv) == sorted(given)
    back = parser.parse_args(argv)
    assert back.deterministic is True and back.enable_prefix_caching is False
    assert back.max_model_len == 48
