"""Verbatim prompt scaffolding (docs/behaviour.md §9.10), owned by the outer tier's context
preparation: for a model that writes its tool calls in text, the tool-schema dump and the
calling-format nudge; stripped again for native models. Also the call forms each tool accepts,
which the prompt describes and `toolloop_fsm.providers.verbatim` parses. Pure values only:
the machines import it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from toolloop_fsm.provider import ToolSpec

SCAFFOLDING_KEY = "toolloop_scaffolding"
"""Key marking a context message the library added; its value says which scaffolding."""

VERBATIM_SCAFFOLDING = "verbatim"


# --------------------------------------------------------------------------- tool call forms
@frozen
class _CallForms:
    """Which argument forms a tool accepts besides a JSON object."""

    accepts_empty: bool
    string_parameter: str | None


_NO_FORMS = _CallForms(accepts_empty=False, string_parameter=None)


def _call_forms(tool: ToolSpec) -> _CallForms:
    schema = tool.parameters
    required_value = schema.get("required")
    required = (
        [name for name in required_value if isinstance(name, str)]
        if isinstance(required_value, list | tuple)
        else []
    )
    string_parameter = None
    if len(required) == 1:
        properties = schema.get("properties")
        spec = properties.get(required[0]) if isinstance(properties, Mapping) else None
        if isinstance(spec, Mapping) and _is_string_type(spec.get("type")):
            string_parameter = required[0]
    return _CallForms(accepts_empty=not required, string_parameter=string_parameter)


def _is_string_type(declared: object) -> bool:
    if declared == "string":
        return True
    return isinstance(declared, list | tuple) and "string" in declared


# --------------------------------------------------------------------------- prompt side
_CALLING_FORMAT = """\
To call a tool, write the call in your reply, exactly in one of these forms:
- name({"parameter": value, ...}) — the arguments as one JSON object (keys in double quotes);
- name() — only for a tool without required parameters;
- name("text") — only for a tool whose single required parameter is a string.
The opening parenthesis follows the tool name directly, and nothing but the arguments goes \
inside the parentheses. The call may stand on its own, be wrapped in backticks \
(`name({...})`), or be the only content of a fenced code block. Make one call, then stop \
writing: the tool's result comes back in the next message. Never write a call you do not \
want to run."""


def _tool_line(tool: ToolSpec) -> str:
    forms = _call_forms(tool)
    shapes = [f"{tool.name}({{...}})"]
    if forms.accepts_empty:
        shapes.append(f"{tool.name}()")
    if forms.string_parameter is not None:
        shapes.append(f'{tool.name}("...")')
    schema = json.dumps(
        {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        ensure_ascii=False,
    )
    return f"- {' or '.join(shapes)}\n  {schema}"


def verbatim_scaffolding(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The context messages that teach a verbatim model its tools and how to call them.

    One system message (none when there are no tools), marked with
    ``{SCAFFOLDING_KEY: VERBATIM_SCAFFOLDING}`` so it can be recognised and stripped.
    """
    if not tools:
        return []
    listing = "\n".join(_tool_line(tool) for tool in tools)
    content = (
        "You have these tools (each with the JSON schema of its arguments):\n"
        f"{listing}\n\n{_CALLING_FORMAT}"
    )
    return [{"role": "system", "content": content, SCAFFOLDING_KEY: VERBATIM_SCAFFOLDING}]


def is_verbatim_scaffolding(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is one `verbatim_scaffolding` added."""
    return message.get(SCAFFOLDING_KEY) == VERBATIM_SCAFFOLDING


def strip_verbatim_scaffolding(context: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``context`` without the verbatim scaffolding messages (other messages kept as they are)."""
    return [
        message if isinstance(message, dict) else dict(message)
        for message in context
        if not is_verbatim_scaffolding(message)
    ]


def prepare_context(
    context: Sequence[Mapping[str, Any]],
    tools: Sequence[ToolSpec],
    *,
    verbatim: bool,
) -> list[dict[str, Any]]:
    """The context for one attempt: scaffolding present exactly when the model is verbatim.

    Existing scaffolding is always stripped first, so preparing a context again (for example
    native → verbatim → native fallbacks) never stacks or leaks it. The scaffolding goes right
    after the leading system messages, keeping the host's own system prompt first.
    """
    stripped = strip_verbatim_scaffolding(context)
    if not verbatim:
        return stripped
    at = 0
    while at < len(stripped) and stripped[at].get("role") == "system":
        at += 1
    return [*stripped[:at], *verbatim_scaffolding(tools), *stripped[at:]]


__all__ = [
    "SCAFFOLDING_KEY",
    "VERBATIM_SCAFFOLDING",
    "is_verbatim_scaffolding",
    "prepare_context",
    "strip_verbatim_scaffolding",
    "verbatim_scaffolding",
]
