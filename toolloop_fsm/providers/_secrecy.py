"""Secrecy for the adapters: no API key, nor any piece of one, leaves an adapter in any text.

Owns the one rule every adapter applies to every text it lets out:

* `redact` replaces every occurrence of a secret — and, for a secret of `FRAGMENT` (8) or
  more characters, every run of 8 or more characters copied from it — with ``[REDACTED]``,
  as it does every ``key=`` query value and a URL's ``user:password@``. Pieces count because
  servers quote keys partly: a body cut short, an echo that masks the middle but keeps a long
  tail. A secret shorter than 8 characters is only matched whole: runs that short of it would
  hit ordinary words.
* `quote` is how a message includes text it did not write (an error body, a bad line):
  redacted first, then cut to a limit. In that order because a cut can leave the head of a
  key at the end, where the whole key no longer matches; once redacted, no prefix of the text
  can hold 8 characters of a key.
* `header_secrets` names the credentials among request headers: a proxy's token is as
  secret as an API key.
* `provider_secrets` names the keys a provider object holds (its ``secrets`` or
  ``api_key``, and those of a provider it wraps): the turn's keys when no chain names them.
* `redacted_error` is the copy of a `ProviderError` that leaves an adapter: message redacted
  and bounded, nothing chained to it. The HTTP stream base raises it outside any ``except``
  block, so neither ``__cause__`` nor ``__context__`` carries an httpx exception (whose
  request holds the headers) or a JSON error (whose ``doc`` holds the raw text) out of the
  adapter.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from toolloop_fsm.provider import ProviderError

REDACTED = "[REDACTED]"
FRAGMENT = 8
"""The shortest run of a secret's characters that is redacted on its own."""
MESSAGE_LIMIT = 2000
"""The longest message, in characters, of an error that leaves an adapter."""

_KEY_IN_QUERY = re.compile(r"((?:[?&;]|\b)(?:key|api[_-]?key)=)[^&\s\"'#]+", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://)[^/\s:@]*:[^/\s@]*@")
# Header names that carry credentials: authorization, x-api-key, api-key, x-goog-api-key,
# proxy-authorization, x-auth-token, cookie, …
_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|cookie|credential", re.IGNORECASE)
# "Bearer <credential>", "Basic <credential>": the credential alone is secret too.
_AUTH_SCHEME = re.compile(r"^[A-Za-z][\w.-]*\s+(\S+)$")


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every secret, every 8+ character run of a secret, every ``key=`` query
    value and every URL password replaced by ``[REDACTED]`` (overlapping or touching matches
    as one)."""
    spans = secret_spans(text, secrets)
    if spans:
        text = _mask(text, spans)
    text = _URL_PASSWORD.sub(r"\1" + REDACTED + "@", text)
    return _KEY_IN_QUERY.sub(r"\1" + REDACTED, text)


def secret_spans(text: str, secrets: Iterable[str | None]) -> list[tuple[int, int]]:
    """Where in ``text`` `redact` finds a secret: the ``(start, end)`` of every occurrence
    of every piece (`pieces`), unsorted, overlapping ones each on its own."""
    spans: list[tuple[int, int]] = []
    for secret in secrets:
        if not secret:
            continue
        size = min(len(secret), FRAGMENT)
        for piece in pieces(secret):
            found = text.find(piece)
            while found != -1:
                spans.append((found, found + size))
                found = text.find(piece, found + 1)
    return spans


def pieces(secret: str) -> dict[str, None]:
    """Every run of `FRAGMENT` characters of ``secret`` (the whole of a shorter one), in
    order, once each; a longer run is a union of these."""
    size = min(len(secret), FRAGMENT)
    return dict.fromkeys(secret[i : i + size] for i in range(len(secret) - size + 1))


def fragment_pattern(secrets: Iterable[str | None]) -> re.Pattern[str] | None:
    """One compiled pattern that finds any piece of ``secrets`` `redact` would replace: a
    quick test that spares `redact` the texts holding none. Made once per set of secrets (a
    turn asks for its keys' pattern at its start; building it is a few dozen escapes)."""
    return _fragment_pattern(tuple(secret for secret in secrets if secret))


@functools.lru_cache(maxsize=64)
def _fragment_pattern(secrets: tuple[str, ...]) -> re.Pattern[str] | None:
    found: dict[str, None] = {}
    for secret in secrets:
        found.update(pieces(secret))
    if not found:
        return None
    return re.compile("|".join(map(re.escape, found)))


def _mask(text: str, spans: list[tuple[int, int]]) -> str:
    spans.sort()
    parts: list[str] = []
    position = 0
    start, end = spans[0]
    for next_start, next_end in spans[1:]:
        if next_start <= end:
            end = max(end, next_end)
            continue
        parts += (text[position:start], REDACTED)
        position = end
        start, end = next_start, next_end
    parts += (text[position:start], REDACTED, text[end:])
    return "".join(parts)


def quote(text: str, secrets: Iterable[str | None], limit: int) -> str:
    """``text`` redacted, then cut to ``limit`` characters (an ellipsis marks the cut)."""
    text = redact(text, secrets)
    return text if len(text) <= limit else text[:limit] + "…"


def header_secrets(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The credentials in request headers: the value of every header whose name speaks of
    auth, a key, a token, a secret, a cookie or a credential, and the credential alone of a
    ``<scheme> <credential>`` value."""
    found: list[str] = []
    for name, value in headers.items():
        if not value or not _CREDENTIAL_HEADER.search(name):
            continue
        found.append(value)
        scheme = _AUTH_SCHEME.match(value.strip())
        if scheme is not None:
            found.append(scheme.group(1))
    return tuple(found)


def provider_secrets(provider: Any) -> tuple[str, ...]:
    """The keys a provider holds: its ``secrets`` (an HTTP adapter's key and credential
    headers) or ``api_key``, and those of every provider it wraps (``.provider``)."""
    found: list[str] = []
    seen: set[int] = set()
    current = provider
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for name in ("secrets", "api_key"):
            try:
                value = getattr(current, name, None)
            except Exception:  # a property that breaks names no key
                continue
            if isinstance(value, str):
                found.append(value)
            elif isinstance(value, list | tuple | frozenset | set):
                found.extend(item for item in value if isinstance(item, str))
        try:
            current = getattr(current, "provider", None)
        except Exception:
            current = None
    return tuple(dict.fromkeys(secret for secret in found if secret))


def redacted_error(error: ProviderError, secrets: Iterable[str | None]) -> ProviderError:
    """A copy of ``error`` fit to leave an adapter: its message redacted and cut to
    `MESSAGE_LIMIT`, every other field kept. Raise it outside any ``except`` block so that no
    exception is chained to it."""
    return ProviderError(
        quote(error.message, secrets, MESSAGE_LIMIT),
        kind=error.kind,
        retryable=error.retryable,
        status_code=error.status_code,
        retry_after=error.retry_after,
    )


__all__ = [
    "FRAGMENT",
    "MESSAGE_LIMIT",
    "REDACTED",
    "fragment_pattern",
    "header_secrets",
    "pieces",
    "provider_secrets",
    "quote",
    "redact",
    "redacted_error",
    "secret_spans",
]
