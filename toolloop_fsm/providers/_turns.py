"""How the neutral context becomes turns of parts, for the adapters whose turns hold a list of
parts (Anthropic's ``content`` blocks, Gemini's ``parts``): one rule for both.

Owns two things:

* `content_parts` — a context message's content as parts: a string as one text part (none for
  an empty string), a list as the parts it already holds (a host that speaks the provider's
  format natively), anything else as its text;
* `append_turn` — parts added as a turn of a role, merged into the last turn when that has the
  same role: the APIs want the two sides' turns to alternate, so consecutive same-role messages
  of the neutral context become one turn rather than a rejected request.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any


def content_parts(content: Any, text_part: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """``content`` as parts, a text written as ``text_part`` makes it (module docstring)."""
    if isinstance(content, str):
        return [text_part(content)] if content else []
    if isinstance(content, Sequence):
        return [dict(part) for part in content if isinstance(part, Mapping)]
    return [text_part(str(content))]


def append_turn(
    turns: list[dict[str, Any]], role: str, parts: list[dict[str, Any]], *, key: str
) -> None:
    """``parts`` as a turn of ``role`` whose parts are under ``key``, or added to the last turn
    when it has that role (module docstring); no parts add nothing."""
    if not parts:
        return
    if turns and turns[-1]["role"] == role:
        turns[-1][key].extend(parts)
    else:
        turns.append({"role": role, key: parts})


__all__ = ["append_turn", "content_parts"]
