"""Typed reads of the SDKs' union-typed results: a Responses stream's events are one union of some
sixty types, its items one of some thirty and a Message's content blocks one of a dozen, so a test
that reads the response a stream ended with, an item's fields or a block's text narrows here (an
assert, which fails the test on another type)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from anthropic.types import ContentBlock, TextBlock, ToolUseBlock
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFailedEvent,
    ResponseIncompleteEvent,
    ResponseStreamEvent,
)
from pydantic import BaseModel

from tests.conftest import present

T = TypeVar("T")


def as_type(value: object, cls: type[T]) -> T:
    """value, asserted to be a cls: one member of an SDK union."""
    assert isinstance(value, cls), type(value)
    return value


def extra_field(model: BaseModel, name: str) -> Any:
    """A field the server sends that the SDK's model does not declare (it keeps it as an extra)."""
    return present(model.model_extra)[name]


def final_response(events: Sequence[ResponseStreamEvent]) -> Response:
    """The response a stream's last event carries: completed, incomplete (cut) or failed."""
    last = events[-1]
    ending = ResponseCompletedEvent | ResponseIncompleteEvent | ResponseFailedEvent
    assert isinstance(last, ending), last.type
    return last.response


def text_of(block: ContentBlock) -> str:
    assert isinstance(block, TextBlock), block.type
    return block.text


def tool_use_of(block: ContentBlock) -> ToolUseBlock:
    assert isinstance(block, ToolUseBlock), block.type
    return block
