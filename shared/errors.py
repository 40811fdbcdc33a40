"""Typed errors. Each carries the HTTP status the gateway answers with and an OpenAI error type."""
from __future__ import annotations


class ConveyorError(Exception):
    status = 500
    type = "internal_error"


class InvalidRequest(ConveyorError):
    """The request itself is wrong; retrying it unchanged will fail again."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's machine-readable reason, e.g. "context_length_exceeded"


class Overloaded(ConveyorError):
    """Refused before anything was queued: the same request may well succeed later.

    retry_after: seconds the client should wait (the Retry-After header, the WebSocket error frame);
    reason: which limit refused it, the label of conveyor_requests_rejected_total."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int, reason: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class EngineDead(ConveyorError):
    """The engine process is gone or never answered the handshake."""

    status = 503
    type = "service_unavailable"


class ProtocolError(ConveyorError):
    """A message on the wire could not be decoded."""

    status = 400
    type = "protocol_error"

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
