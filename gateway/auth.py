"""Who may call the gateway, and whose prefix cache a request may share: the API keys and
--cache-isolation.

The keys come from `--api-key` (several after one flag, as vLLM spells it, or the flag repeated),
`--api-key-file` (one key a line: keys stay out of `ps`) and CONVEYOR_API_KEY (one key a line; how
`serve` hands every key to its gateway workers). A request's key is found by comparing its SHA-256
with every key's in constant time, so neither the key nor its length shows in the time taken.

With `--cache-isolation per-key`, each key stands for one tenant: its requests' prefix-cache hashes
are salted with an HMAC of the key (the key never reaches the engine), mixed with the request's own
`cache_salt` when it gives one. Requests under one key share their cache; other keys learn nothing
from `cached_tokens` (docs/prefix_caching.md). This module imports no aiohttp: the CLI builds its
flags before prometheus_client may be imported.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ISOLATION = ("none", "per-key")
_SALT_CONTEXT = b"conveyor cache isolation"  # an HMAC of the key for this purpose and no other


@dataclass(frozen=True, slots=True)
class Key:
    digest: bytes  # SHA-256 of the key: what a given key is compared with
    # HMAC-SHA256(key, _SALT_CONTEXT), hex: the key's cache salt under per-key isolation
    tenant: str


@dataclass(frozen=True)
class Auth:
    """The accepted keys (none: the gateway is open) and the cache isolation mode."""

    keys: tuple[str, ...] = field(default=(), repr=False)
    cache_isolation: str = "none"
    _table: tuple[Key, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_isolation not in ISOLATION:
            raise ValueError(f"cache_isolation must be one of {ISOLATION}, got "
                             f"{self.cache_isolation!r}")
        if self.cache_isolation == "per-key" and not self.keys:
            raise ValueError("--cache-isolation per-key needs API keys (--api-key or "
                             "--api-key-file): without them every client is one tenant")
        if any(not k or k != k.strip() or not k.isprintable() for k in self.keys):
            raise ValueError("an API key is empty, or has surrounding whitespace or a control "
                             "character (no HTTP header can carry it)")
        table = tuple(Key(_digest(k), hmac.new(k.encode(), _SALT_CONTEXT, "sha256").hexdigest())
                      for k in self.keys)
        object.__setattr__(self, "_table", table)

    @property
    def per_key(self) -> bool:
        return self.cache_isolation == "per-key"

    def match(self, given: str) -> Key | None:
        """The key given (None: no such key). Every key is compared, matched or not."""
        digest, found = _digest(given), None
        for key in self._table:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def cache_salt(tenant: str, own: str | None) -> str:
    """The salt the engine hashes a request's prefix with: the key's tenant salt alone, or with the
    request's own cache_salt mixed in (an HMAC again, so the result stays 64 characters and the
    request's salt is not sent as given)."""
    return tenant if own is None else hmac.new(bytes.fromhex(tenant), own.encode(),
                                               "sha256").hexdigest()


class _Keys(argparse.Action):
    """--api-key K [K ...], repeatable. Keys on the command line replace CONVEYOR_API_KEY's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        kept = getattr(namespace, self.dest)
        kept = [] if kept is self.default or kept is None else kept
        setattr(namespace, self.dest, [*kept, *(values or ())])


def read_key_file(path: str) -> tuple[str, ...]:
    """One key a line; blank lines and lines starting with # are skipped. A file without keys is
    refused: an operator who named one meant the server to be closed."""
    try:
        with open(path) as f:
            keys = tuple(s for line in f if (s := line.strip()) and not s.startswith("#"))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None
    if not keys:
        raise argparse.ArgumentTypeError(f"{path} has no keys (one a line)")
    return keys


def add_auth_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--api-key", action=_Keys, nargs="+", default=None, metavar="KEY",
                        help="require one of these keys as 'Authorization: Bearer KEY' (or "
                             "x-api-key); several after one flag or the flag repeated. "
                             "CONVEYOR_API_KEY: one key a line")
    parser.add_argument("--api-key-file", type=read_key_file, default=None, metavar="FILE",
                        help="more keys, one a line (# comments): keys kept out of the process "
                             "list")
    parser.add_argument("--cache-isolation", choices=ISOLATION, default="none",
                        help="per-key: requests share cached prompt prefixes only with requests "
                             "sent with the same API key, so cached_tokens tells no client about "
                             "another's prompts (docs/prefix_caching.md); none (default): one "
                             "cache for all")


def auth_of(args: argparse.Namespace) -> Auth:
    """Every key from the flags and the environment, each once. Raises ValueError for a bad mix."""
    given = args.api_key  # a list from the command line, or CONVEYOR_API_KEY's text
    keys: list[str] = given.splitlines() if isinstance(given, str) else list(given or ())
    keys.extend(args.api_key_file or ())
    return Auth(tuple(dict.fromkeys(s for k in keys if (s := k.strip()))), args.cache_isolation)


def worker_env(auth: Auth) -> dict[str, str]:
    """What a gateway worker of `serve` needs to accept the same keys, in its environment (not its
    argv, which `ps` shows)."""
    return {"CONVEYOR_API_KEY": "\n".join(auth.keys)} if auth.keys else {}
