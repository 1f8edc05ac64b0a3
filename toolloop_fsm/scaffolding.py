"""Verbatim prompt scaffolding (SPEC §5, prompt side), owned by the outer tier's context
preparation: re-exported from `toolloop_fsm.providers.verbatim`, where the calling format it
describes is parsed. Kept importable without any provider code by the machines."""

from __future__ import annotations

from toolloop_fsm.providers.verbatim import (
    SCAFFOLDING_KEY,
    VERBATIM_SCAFFOLDING,
    is_verbatim_scaffolding,
    prepare_context,
    strip_verbatim_scaffolding,
    verbatim_scaffolding,
)

__all__ = [
    "SCAFFOLDING_KEY",
    "VERBATIM_SCAFFOLDING",
    "is_verbatim_scaffolding",
    "prepare_context",
    "strip_verbatim_scaffolding",
    "verbatim_scaffolding",
]
