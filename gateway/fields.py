"""Checks for the nested JSON of the Responses and Messages bodies: every key at every depth is
known (else a 400 naming its path, e.g. `input[2].content[0].foo`), and every value has its type."""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequest

_NAMES = {
    str: "a string",
    bool: "true or false",
    int: "an integer",
    float: "a number",
    dict: "an object",
    list: "a list",
}


def show(path: str, key: Any) -> str:
    return f"{path}.{str(key)[:100]}" if path else str(key)[:100]


def known(
    obj: dict[str, Any], allowed: frozenset[str] | set[str], path: str, what: str = ""
) -> None:
    """Refuse the first key of obj not in allowed, naming its path (null means "not given", as at
    the top level of every route)."""
    for key, value in obj.items():
        if key not in allowed and value is not None:
            where = f" ({what})" if what else ""
            raise InvalidRequest(
                f"unknown field {show(path, key)!r}{where}: it is not supported",
                param=show(path, key),
            )


def typed(
    obj: dict[str, Any], key: str, want: type | tuple[type, ...], path: str, required: bool = False
) -> Any:
    """obj[key] checked against want (None: not given, unless required)."""
    value = obj.get(key)
    name = show(path, key)
    if value is None:
        if required:
            raise InvalidRequest(f"{name} is required", param=name)
        return None
    wants = want if isinstance(want, tuple) else (want,)
    ok = any(
        isinstance(value, w) and not (isinstance(value, bool) and w in (int, float)) for w in wants
    )
    if not ok:
        kinds = " or ".join(_NAMES.get(w, w.__name__) for w in wants)
        raise InvalidRequest(f"{name} must be {kinds}", param=name)
    return value


def obj_at(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{path} must be an object", param=path)
    return value


def metadata(value: Any, path: str) -> None:
    """OpenAI's and Anthropic's metadata: labels that change no output, type-checked."""
    if value is None:
        return
    for key, v in obj_at(value, path).items():
        if not isinstance(v, str):
            raise InvalidRequest(f"{show(path, key)} must be a string", param=show(path, key))
