"""The checks an entry point makes of the host's arguments at the call, before any I/O: a
policy of the other tier, a provider without ``stream`` or a channel without one of its
methods is a `TypeError` naming the entry point's parameter and what is missing, not an
`AttributeError` from deep inside the pump, a ``provider_error``, or a failure after the reply
was sent (the first notice).

They run once per turn, so they read attributes (``callable(getattr(…))``) rather than
``isinstance`` against a ``runtime_checkable`` protocol, which inspects every member on each
call.
"""

from __future__ import annotations

from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy

#: What the pump calls on every channel (``attempt_superseded`` is optional).
CHANNEL_METHODS = ("send_text", "send_expression", "send_notice", "queue_front")


def check_loop_arguments(entry: str, provider: object, channel: object, policy: object) -> None:
    """The arguments of a tool-loop entry point (`run_tool_loop`, `resume_tool_loop`)."""
    if policy is not None and not isinstance(policy, LoopPolicy):
        hint = " (run_generation_turn takes a TurnPolicy)" if isinstance(policy, TurnPolicy) else ""
        raise TypeError(
            f"{entry}(policy=…): expected a LoopPolicy, got {type(policy).__name__}{hint}"
        )
    if not callable(getattr(provider, "stream", None)):
        raise TypeError(
            f"{entry}(provider=…): expected a Provider (an object with a stream method), "
            f"got {type(provider).__name__}"
        )
    check_channel(entry, channel)


def check_chain_arguments(entry: str, channel: object, policy: object) -> None:
    """The arguments of a generation-turn entry point (`run_generation_turn`,
    `resume_generation_turn`); each attempt's provider was checked when it was built."""
    if policy is not None and not isinstance(policy, TurnPolicy):
        hint = (
            " (run_tool_loop takes a LoopPolicy; wrap it as TurnPolicy(loop=…))"
            if isinstance(policy, LoopPolicy)
            else ""
        )
        raise TypeError(
            f"{entry}(policy=…): expected a TurnPolicy, got {type(policy).__name__}{hint}"
        )
    check_channel(entry, channel)


def check_channel(entry: str, channel: object) -> None:
    """``channel`` has every method the pump calls, or the `TypeError` names those it lacks."""
    for name in CHANNEL_METHODS:
        if not callable(getattr(channel, name, None)):
            break
    else:
        return  # the common case, without building the list of what is missing
    missing = [name for name in CHANNEL_METHODS if not callable(getattr(channel, name, None))]
    if missing:
        listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise TypeError(f"{entry}(channel=…): the channel lacks {listed}")
