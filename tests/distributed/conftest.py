"""The end-to-end fixtures (a tiny chat model real servers load in seconds, its offline
reference), for the tests here that run `conveyor serve` with tensor- or data-parallel engines and
kill parts of it."""

from tests.e2e.conftest import tiny_chat_model, tiny_offline  # noqa: F401
