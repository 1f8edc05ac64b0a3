"""Key redaction of a whole result: every text holding a key, or an 8-character run of one,
redacted before a result leaves the outer tier."""

from __future__ import annotations

import re
from collections.abc import (
    Sequence,
)
from typing import Any

from toolloop_fsm.providers._secrecy import redact


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
