"""Key redaction: of a whole result (every text holding a key, or an 8-character run of one,
redacted before a result leaves the outer tier), and of every text a log record or an
observed event carries (`Secrets`)."""

from __future__ import annotations

import re
from collections.abc import (
    Iterable,
    Sequence,
)
from typing import Any

from toolloop_fsm.providers._secrecy import fragment_pattern, redact


class Secrets:
    """The API keys of one turn, for the texts that leave it other than the result: a log
    record, an observed event. Under the outer tier they are every key of the chain; a
    `run_tool_loop` turn knows none (its adapters redact their own), so only ``key=`` query
    values and URL passwords are masked there."""

    __slots__ = ("_leak", "keys")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = tuple(key for key in keys if key)
        self._leak = fragment_pattern(self.keys)

    def clean(self, text: str) -> str:
        """``text`` with every key, every 8-character run of one, every ``key=`` query value
        and every URL password replaced by ``[REDACTED]``."""
        return redact(text, self.keys)

    def holds_any(self, text: str) -> bool:
        """Whether ``text`` holds a key or a run of one (a quick test before `clean`)."""
        return self._leak is not None and self._leak.search(text) is not None


#: A turn that knows no keys.
NO_SECRETS = Secrets()


class RedactedError(Exception):
    """Stands in for a host exception whose message quoted an API key."""


def _scrub(value: Any, keys: Sequence[str], leak: re.Pattern[str]) -> Any:
    """Every text in ``value`` with every key, and every 8-character run of one, redacted
    (the adapters' own rule: a server may quote a key cut short or partly masked). ``leak``
    finds the texts that need it."""
    if isinstance(value, str):
        return redact(value, keys) if leak.search(value) else value
    if isinstance(value, dict):
        return {name: _scrub(item, keys, leak) for name, item in value.items()}
    if isinstance(value, list):
        return [_scrub(item, keys, leak) for item in value]
    return value
