"""Tools as hosts write them: checking a call's arguments against the tool's JSON schema,
calling its handler (an ``async def`` on the event loop, a plain function in a worker
thread), turning whatever the handler does into a `ToolFinished`, and the `tool` decorator
that builds a `Tool` from a typed function.

The pump hands each dispatch here with the tool's own copy of the arguments. Arguments that
break the schema are a failed call naming the path and the rule of each violation
(``arguments.city: required``) and the handler is not called. A handler that raises or
returns something other than a `ToolResult` is a failed call for the model and a WARNING
record with the traceback for the host, on the ``toolloop_fsm.tools`` logger.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import json
import logging
import re
import types
import typing
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import cast
from typing import overload

import fastjsonschema
from attrs import frozen

from toolloop_fsm.events import ToolFinished
from toolloop_fsm.events import ToolOutcomeKind
from toolloop_fsm.host import ApprovalPredicate
from toolloop_fsm.host import Clock
from toolloop_fsm.host import LoopClock
from toolloop_fsm.host import Redactor
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolHandler
from toolloop_fsm.host import ToolReconciler
from toolloop_fsm.host import ToolResult

__all__ = [
    "copy_arguments",
    "finished_with",
    "reconcile_call",
    "run_tool_handler",
    "runs_on_loop",
    "tool",
    "unknown_outcome",
]

_log = logging.getLogger("toolloop_fsm.tools")

#: Schemas whose compiled validators are kept (keyed by the schema's canonical JSON, so tools
#: rebuilt with the same schema share one); a host with more distinct schemas recompiles.
_VALIDATORS_KEPT = 512

#: A worker thread holds a real loop timer in slices this long (see `_RealTimeHold`).
_HOLD_SLICE = 0.01


# --------------------------------------------------------------------------- arguments
#: Values `copy.deepcopy` returns as they are.
_ATOMS = frozenset({str, int, float, bool, type(None)})


def copy_arguments(value: Any) -> Any:
    """A deep copy of call arguments: what `copy.deepcopy` makes of them. They are JSON
    values (dicts, lists, strings, numbers), which this copies without deepcopy's memo
    bookkeeping, several times faster; any other kind of value is handed to
    `copy.deepcopy`. A tool gets its own copy, so one that edits its arguments rewrites
    neither the call the model made nor the history sent back."""
    kind = type(value)
    if kind is dict:
        return {key: copy_arguments(item) for key, item in value.items()}
    if kind is list:
        return [copy_arguments(item) for item in value]
    if kind in _ATOMS:
        return value
    return copy.deepcopy(value)


# --------------------------------------------------------------------------- dispatching
async def run_tool_handler(
    tool: Tool, dispatch: int, arguments: dict[str, Any], ctx: ToolContext, *, deadline: float
) -> ToolFinished:
    """Check ``arguments`` against the tool's schema, then run its handler on them; whatever
    happens becomes a `ToolFinished` value — any exception, `BaseException` subclasses and
    `GeneratorExit` included — except cancellation and the process going down, which
    propagate. ``deadline`` is the tool's deadline in seconds: a handler running in a worker
    thread holds a real loop timer for at most that long (see `_RealTimeHold`)."""
    refusal = _check_arguments(tool, dispatch, arguments)
    if refusal is not None:
        return ToolFinished(dispatch, ToolOutcomeKind.FAILED, error=refusal)
    handler = tool.handler
    try:
        if runs_on_loop(handler):
            result = await typing.cast(Awaitable[Any], handler(arguments, ctx))
        else:
            result = await _in_worker_thread(handler, arguments, ctx, deadline)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        _log.warning(
            "tool %s (dispatch %d) raised %s; the call failed and the model is told so",
            tool.name,
            dispatch,
            type(err).__name__,
            exc_info=err,
            extra={"tool": tool.name, "dispatch": dispatch},
        )
        return ToolFinished(dispatch, ToolOutcomeKind.RAISED, error=f"{type(err).__name__}: {err}")
    if not isinstance(result, ToolResult):
        _log.warning(
            "tool %s (dispatch %d) returned %s, not ToolResult; the call failed and the model "
            "is told so",
            tool.name,
            dispatch,
            type(result).__name__,
            extra={"tool": tool.name, "dispatch": dispatch},
        )
        return ToolFinished(
            dispatch,
            ToolOutcomeKind.RAISED,
            error=f"the handler returned {type(result).__name__}, not ToolResult",
        )
    return finished_with(dispatch, result)


def finished_with(dispatch: int, result: ToolResult) -> ToolFinished:
    """The `ToolFinished` of dispatch ``dispatch`` whose outcome is ``result`` (a run's or a
    reconcile hook's)."""
    return ToolFinished(
        dispatch,
        ToolOutcomeKind.SUCCEEDED if result.success else ToolOutcomeKind.FAILED,
        data=result.data,
        message=result.message,
        end_turn=result.end_turn,
        delivered=result.delivered,
        expression=result.expression,
        context_restart=result.context_restart,
        error=None if result.success else (result.message or "the tool reported a failure"),
    )


# --------------------------------------------------------------------------- calls in doubt
def unknown_outcome(tool: str, cut_off: str) -> ToolFinished:
    """What the model is told of a call in doubt that nobody could settle (docs/behaviour.md
    §3.9): its outcome is unknown, and why (``cut_off``: how the call was cut off). The
    dispatch is filled in by the shell that feeds it."""
    return ToolFinished(
        -1,
        ToolOutcomeKind.RAISED,
        error=(
            f"the outcome of {tool} is unknown: {cut_off}; it was not run again, so it may or "
            "may not have taken effect"
        ),
        in_doubt=True,
    )


async def reconcile_call(
    tool: Tool,
    dispatch: int,
    arguments: dict[str, Any],
    ctx: ToolContext,
    *,
    budget: float,
    clock: Clock,
) -> ToolFinished | None:
    """Ask ``tool``'s reconcile hook what really happened to dispatch ``dispatch``, cut off
    mid-run (docs/behaviour.md §3.9): its `ToolResult` as the call's `ToolFinished`, or
    ``None`` when it cannot tell — it has no hook, answers ``None``, raises anything (a
    `BaseException` subclass too), returns something other than a `ToolResult`, or does not
    answer within ``budget`` seconds on ``clock`` (it is then cancelled and never awaited
    again). Each of those is a WARNING record naming the tool. Cancellation and the process
    going down propagate. Both shells settle a call through here: the pump in process, a
    worker's activity for a durable turn."""
    hook = tool.reconcile
    if hook is None:
        return None
    if runs_on_loop(hook):
        asking = typing.cast(Coroutine[Any, Any, Any], hook(arguments, ctx))
    else:
        asking = _in_worker_thread(hook, arguments, ctx, budget)
    task = asyncio.get_running_loop().create_task(asking, name=f"reconcile {tool.name}")
    task.add_done_callback(_retrieved)
    expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    timer = clock.call_later(budget, _expire, expired)
    try:
        await asyncio.wait((task, expired), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if not task.done():
        task.cancel()  # never awaited again: a hook that ignores it is left to itself
        return _cannot_tell(tool, dispatch, f"did not answer within {budget:g} s")
    if task.cancelled():
        return _cannot_tell(tool, dispatch, "was cancelled")
    err = task.exception()
    if isinstance(err, KeyboardInterrupt | SystemExit):
        raise err
    if err is not None:
        return _cannot_tell(tool, dispatch, f"raised {type(err).__name__}: {err}", err)
    answer = task.result()
    if answer is None:
        _log.warning(
            "the reconcile hook of tool %s (dispatch %d) cannot tell what happened; the call "
            "stays in doubt",
            tool.name,
            dispatch,
            extra={"tool": tool.name, "dispatch": dispatch, "failure": "in_doubt"},
        )
        return None
    if not isinstance(answer, ToolResult):
        return _cannot_tell(
            tool, dispatch, f"returned {type(answer).__name__}, not ToolResult or None"
        )
    return finished_with(dispatch, answer)


def _cannot_tell(
    tool: Tool, dispatch: int, problem: str, err: BaseException | None = None
) -> ToolFinished | None:
    """``None``, the hook's answer when it failed, after a WARNING record saying how."""
    _log.warning(
        "the reconcile hook of tool %s (dispatch %d) %s; the call stays in doubt",
        tool.name,
        dispatch,
        problem,
        exc_info=err,
        extra={"tool": tool.name, "dispatch": dispatch, "failure": "in_doubt"},
    )
    return None


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A hook's task given up on still has its failure retrieved (nobody awaits it)."""
    if not task.cancelled():
        task.exception()


def runs_on_loop(handler: Callable[..., Any]) -> bool:
    """Whether ``handler`` is awaited on the event loop: an ``async def`` function or method,
    a `functools.partial` of one, or an object whose ``__call__`` is ``async def``. Anything
    else is a plain callable and runs in a worker thread (if it returns an awaitable, as a
    lambda wrapping a coroutine function does, that is then awaited on the loop)."""
    if type(handler) is types.FunctionType and handler.__code__.co_flags & inspect.CO_COROUTINE:
        return True  # the common case, answered without the general inspection
    target: Any = handler
    while isinstance(target, functools.partial):
        target = target.func
    if inspect.iscoroutinefunction(target):
        return True
    if inspect.isroutine(target) or inspect.isclass(target):
        return False
    return inspect.iscoroutinefunction(type(target).__call__)


async def _in_worker_thread(
    handler: ToolHandler | ToolReconciler,
    arguments: dict[str, Any],
    ctx: ToolContext,
    deadline: float,
) -> Any:
    """Run a plain handler in the loop's default executor, with the caller's context
    variables. A thread cannot be cancelled: when the tool is cancelled (its deadline, a
    stop) this goes on waiting for the thread, so that the pump abandons it after its grace
    and names it like any host code that ignores its cancellation; the cancellation is
    raised once the thread returns."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, handler, arguments, ctx)
    finished = loop.run_in_executor(None, call)
    hold = None if isinstance(ctx.clock, LoopClock) else _RealTimeHold(loop, deadline)
    cancelled: asyncio.CancelledError | None = None
    try:
        while not finished.done():
            try:
                await asyncio.wait((finished,))
            except asyncio.CancelledError as err:
                cancelled = err
                if hold is not None:
                    # past its deadline or stopped: the thread no longer holds time still
                    hold.release()
                    hold = None
    finally:
        if hold is not None:
            hold.release()
    if cancelled is not None:
        if not finished.cancelled() and finished.exception() is None:
            late = finished.result()
            if inspect.iscoroutine(late):
                late.close()  # never to be awaited: close it rather than leave it warning
        raise cancelled
    result = finished.result()
    if inspect.isawaitable(result):
        result = await result
    return result


class _RealTimeHold:
    """Keeps a real loop timer pending while a worker thread runs, for at most ``seconds``.

    A worker thread leaves the event loop idle. A clock that moves virtual time whenever the
    loop is idle and no real timer is pending (the test kit's `VirtualClock`) would jump over
    the thread's work and fire the tool's deadline early, so the thread holds a real timer
    — for no longer than the tool's deadline, after which the clock may fire it. The timer
    is renewed in short slices, so that such a clock sees the hold end within a slice of the
    thread returning. The real clock (`LoopClock`) needs no hold and gets none."""

    __slots__ = ("_handle", "_loop", "_until")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._loop = loop
        self._until = loop.time() + seconds
        self._handle: asyncio.TimerHandle | None = None
        self.renew()

    def renew(self) -> None:
        left = self._until - self._loop.time()
        if left > 0:
            self._handle = self._loop.call_later(min(left, _HOLD_SLICE), self.renew)
        else:
            self._handle = None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# --------------------------------------------------------------------------- arguments
@frozen
class _UnusableSchema:
    """A tool schema the validator compiler refused, with its message."""

    message: str


def _check_arguments(tool: Tool, dispatch: int, arguments: dict[str, Any]) -> str | None:
    """``None`` when the arguments fit the tool's schema, else what the model is told."""
    validate = _validator(tool.schema_key)
    if isinstance(validate, _UnusableSchema):
        _log.error(
            "tool %s (dispatch %d) has a parameters schema that does not compile (%s); the "
            "call failed and the model is told so",
            tool.name,
            dispatch,
            validate.message,
            extra={"tool": tool.name, "dispatch": dispatch},
        )
        return f"the tool's parameters schema is invalid, so it was not called: {validate.message}"
    try:
        validate(arguments)
    except fastjsonschema.JsonSchemaValueException as err:
        refusal = _refusal(tool.schema_key, arguments, err)
        _log.debug(
            "tool %s (dispatch %d): arguments refused (%s)",
            tool.name,
            dispatch,
            refusal,
            extra={"tool": tool.name, "dispatch": dispatch},
        )
        return refusal
    except Exception as err:  # a validator that breaks on a value is not the model's fault
        _log.warning(
            "tool %s (dispatch %d): checking the arguments raised %s; the call failed",
            tool.name,
            dispatch,
            type(err).__name__,
            exc_info=err,
            extra={"tool": tool.name, "dispatch": dispatch},
        )
        return f"the arguments could not be checked ({type(err).__name__}: {err})"
    return None


def _compiled(schema_key: str) -> Callable[[Any], Any] | _UnusableSchema:
    """The compiled validator of a schema, by its canonical JSON (a few milliseconds)."""
    try:
        return fastjsonschema.compile(
            json.loads(schema_key),
            handlers=_NO_REMOTE_SCHEMAS,
            # validation only: the handler receives the arguments the model sent, no defaults
            use_default=False,
        )
    except Exception as err:  # the compiler's own refusals, and a bad regex pattern's
        return _UnusableSchema(f"{type(err).__name__}: {err}")


#: A tool's schema, compiled on the first dispatch that needs it, then kept.
_validator = functools.lru_cache(maxsize=_VALIDATORS_KEPT)(_compiled)
#: The parts of a schema a refusal checks one by one (`_ViolationSearch`), kept apart so
#: that they never push a whole schema out.
_part_validator = functools.lru_cache(maxsize=_VALIDATORS_KEPT)(_compiled)


class _RemoteSchemasRefused(Mapping[str, Callable[[str], Any]]):
    """A ``$ref`` to another document is never fetched: a dispatch must not wait on the
    network (or read a file) to check its arguments. Claims every URI scheme and refuses."""

    def __getitem__(self, scheme: str) -> Callable[[str], Any]:
        return _refuse_remote

    def __contains__(self, scheme: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _refuse_remote(uri: str) -> Any:
    raise fastjsonschema.JsonSchemaDefinitionException(
        f"$ref {uri} names another document; a tool's schema must be self-contained"
    )


_NO_REMOTE_SCHEMAS = _RemoteSchemasRefused()


#: How many violations a refusal names; it counts the rest ("; and 3 more").
MAX_VIOLATIONS_NAMED = 10
#: How deep the search for every violation goes into nested values (and ``$ref`` chains);
#: below that, a value is checked whole and its first violation named.
_SEARCH_DEPTH = 32


def _refusal(
    schema_key: str, arguments: Any, first: fastjsonschema.JsonSchemaValueException
) -> str:
    """What the model is told of arguments that break the schema: every violation, up to
    `MAX_VIOLATIONS_NAMED` of them, each as `_violations` words it."""
    try:
        found = _ViolationSearch(json.loads(schema_key)).every_violation(arguments)
    except Exception:  # the search is a courtesy: the validator's own finding stands
        found = []
    if not found:
        found = _violations(first)
    named = found[:MAX_VIOLATIONS_NAMED]
    more = len(found) - len(named)
    return "; ".join(named) + (f"; and {more} more" if more else "")


class _ViolationSearch:
    """Every violation of a schema by a value. fastjsonschema stops at the first, so once it
    has refused the arguments (never on the way to a handler) the schema is taken apart
    where the value is: each property of an object and each item of an array is checked
    against its own schema, and the object or array itself against the schema with those
    left open, then again without each of ``required`` and ``additionalProperties`` that
    refused it. Each part is a looser schema than the whole, so whatever it refuses the whole
    refuses too. A part is compiled with the root's ``$schema``, ``$defs`` and
    ``definitions``, so its local ``$ref`` still resolve; parts are compiled once, then kept."""

    __slots__ = ("found", "root", "shared")

    def __init__(self, root: Any) -> None:
        self.root = root
        kept = ("$schema", "$defs", "definitions")
        self.shared = {k: root[k] for k in kept if k in root} if isinstance(root, dict) else {}
        self.found: list[str] = []

    def every_violation(self, arguments: Any) -> list[str]:
        self._search(self.root, arguments, "arguments", 0)
        return self.found

    def _search(self, schema: Any, value: Any, path: str, depth: int) -> None:
        schema = self._resolved(schema)
        if depth < _SEARCH_DEPTH and isinstance(schema, dict):
            properties = schema.get("properties")
            items = schema.get("items")
            if isinstance(value, dict) and isinstance(properties, dict) and properties:
                opened: dict[str, Any] = {
                    key: {} for key in properties
                }  # named: so additional ones are known
                self._check_open(schema | {"properties": opened}, value, path)
                for key, item in value.items():
                    if key in properties:
                        self._search(properties[key], item, f"{path}.{key}", depth + 1)
                return
            if isinstance(value, list) and isinstance(items, dict):
                self._check_open(schema | {"items": {}}, value, path)
                for index, item in enumerate(value):
                    self._search(items, item, f"{path}[{index}]", depth + 1)
                return
        self._check(schema, value, path)

    def _resolved(self, schema: Any) -> Any:
        """A schema that is a local ``$ref`` (whose siblings draft 7 ignores), followed."""
        for _ in range(_SEARCH_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                return schema
            reference: str = schema["$ref"]
            if not reference.startswith("#"):
                return schema
            target: Any = self.root
            for step in filter(None, reference[1:].split("/")):
                step = step.replace("~1", "/").replace("~0", "~")
                target = target[int(step)] if isinstance(target, list) else target[step]
            schema = target
        return schema

    def _check_open(self, schema: dict[str, Any], value: Any, path: str) -> None:
        """An object or array against its own keywords, its members left open: after a
        ``required`` or ``additionalProperties`` refusal (which names every property it
        refused) the check goes on without that keyword, for what else there is."""
        while (err := self._check(schema, value, path)) is not None:
            if err.rule not in ("required", "additionalProperties") or err.rule not in schema:
                return
            schema = {k: v for k, v in schema.items() if k != err.rule}

    def _check(
        self, schema: Any, value: Any, path: str
    ) -> fastjsonschema.JsonSchemaValueException | None:
        part = {**self.shared, **schema} if isinstance(schema, dict) else schema
        validate = _part_validator(json.dumps(part, sort_keys=True, separators=(",", ":")))
        if isinstance(validate, _UnusableSchema):
            return None
        try:
            validate(value)
        except fastjsonschema.JsonSchemaValueException as err:
            self.found += _violations(err, path)
            return err
        return None


def _violations(err: fastjsonschema.JsonSchemaValueException, at: str = "arguments") -> list[str]:
    """``<at>.<path>: <rule> (<what it requires>)`` for the violation found (``at``: where
    the value checked is in the arguments); for a missing required property or one the
    schema does not allow, the path names it."""
    name = str(err.name or "data")
    path = at + name[len("data") :] if name.startswith("data") else f"{at}.{name}"
    value = err.value
    definition = err.definition if isinstance(err.definition, Mapping) else {}
    if err.rule == "required" and isinstance(value, Mapping):
        required = err.rule_definition if isinstance(err.rule_definition, list) else []
        missing = [str(key) for key in required if key not in value]
        if missing:
            return [f"{path}.{key}: required" for key in missing]
    if err.rule == "additionalProperties" and isinstance(value, Mapping):
        known = definition.get("properties", {})
        patterns = list(definition.get("patternProperties", {}))
        extra = [
            str(key)
            for key in value
            if key not in known and not any(re.search(p, str(key)) for p in patterns)
        ]
        if extra:
            return [f"{path}.{key}: additionalProperties (not allowed)" for key in extra]
    message = str(err.message)
    # the message starts with the value's name ("data.days must be ..."): keep what follows
    if message.startswith(name + " "):
        message = message[len(name) + 1 :]
    return [f"{path}: {err.rule} ({message})" if err.rule else f"{path}: {message}"]


# --------------------------------------------------------------------------- @tool
_Function = Callable[..., Any]
#: Turns checked arguments into the annotated types, or says why it cannot
_Conversion = Callable[[dict[str, Any]], "dict[str, Any] | str"]


@overload
def tool(function: _Function, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    schema: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    requires_follow_up: bool = True,
    replay: str = "reuse",
    redact: Redactor | None = None,
    idempotent: bool = False,
    reconcile: ToolReconciler | None = None,
    sequential: bool = False,
    repeatable: bool = False,
    needs_approval: bool | ApprovalPredicate = False,
) -> Callable[[_Function], Tool]: ...


def tool(
    function: _Function | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    schema: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    requires_follow_up: bool = True,
    replay: str = "reuse",
    redact: Redactor | None = None,
    idempotent: bool = False,
    reconcile: ToolReconciler | None = None,
    sequential: bool = False,
    repeatable: bool = False,
    needs_approval: bool | ApprovalPredicate = False,
) -> Tool | Callable[[_Function], Tool]:
    """Build a `Tool` from a function: ``@tool`` or ``@tool(name=..., ...)``.

    The tool's name is the function's (or ``name``), its description the first paragraph of
    the docstring (or ``description``), its parameters schema ``schema`` or else derived
    from the signature and type hints by pydantic (the ``toolloop-fsm[pydantic]`` extra).
    The handler calls the function with the arguments as keyword arguments — converted to
    the annotated types by pydantic when it derived the schema, as the model sent them when
    ``schema`` is given — plus the `ToolContext` for a parameter annotated ``ToolContext``.
    An ``async def`` runs on the event loop, a plain ``def`` in a worker thread.
    ``idempotent=True`` lets a durable turn run the tool again when its worker is lost.
    ``reconcile`` is the tool's reconcile hook (`Tool.reconcile`, docs/behaviour.md §3.9): it
    is called as any hook is, with the arguments as the model sent them and the context.
    ``sequential=True`` makes the tool a barrier in a batch of calls (`Tool.sequential`).
    ``repeatable=True`` exempts it from the repeated-call guard (`Tool.repeatable`).
    ``needs_approval`` makes its calls (all, or those its predicate picks) wait for a person
    (`Tool.needs_approval`, docs/behaviour.md §3.13).
    """
    options = _ToolOptions(
        name,
        description,
        schema,
        timeout,
        requires_follow_up,
        replay,
        redact,
        idempotent,
        reconcile,
        sequential,
        repeatable,
        needs_approval,
    )
    if function is None:
        return functools.partial(_build_tool, options=options)
    return _build_tool(function, options=options)


@frozen
class _ToolOptions:
    name: str | None
    description: str | None
    schema: Mapping[str, Any] | None
    timeout: float | None
    requires_follow_up: bool
    replay: str
    redact: Redactor | None
    idempotent: bool = False
    reconcile: ToolReconciler | None = None
    sequential: bool = False
    repeatable: bool = False
    needs_approval: bool | ApprovalPredicate = False


def _build_tool(function: _Function, *, options: _ToolOptions) -> Tool:
    if not callable(function):
        raise TypeError(f"@tool decorates a function, got {type(function).__name__}")
    label = getattr(function, "__name__", None) or type(function).__name__
    name = options.name if options.name is not None else label
    description = options.description
    if description is None:
        description = _first_paragraph(inspect.getdoc(function))
        if not description:
            raise TypeError(
                f"@tool: {label} has no docstring to describe it to the model; give it one "
                "or pass description="
            )
    signature = inspect.signature(function)
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.VAR_POSITIONAL):
            raise TypeError(
                f"@tool: {label} takes {parameter.name} positionally; a tool's arguments are "
                "passed by name"
            )
    hints = _type_hints(function, label, explicit_schema=options.schema is not None)
    context = [p.name for p in signature.parameters.values() if _is_context(hints.get(p.name))]
    if len(context) > 1:
        raise TypeError(f"@tool: {label} has more than one ToolContext parameter: {context}")
    context_name = context[0] if context else None
    if options.schema is not None:
        parameters: Mapping[str, Any] = options.schema
        convert: _Conversion | None = None
    else:
        parameters, convert = _derived_schema(function, label, signature, hints, context_name)
    handler = _handler_for(function, context_name, convert)
    return Tool(
        name,
        description,
        parameters,
        handler,
        requires_follow_up=options.requires_follow_up,
        timeout=options.timeout,
        redact=options.redact,
        replay=options.replay,
        idempotent=options.idempotent,
        reconcile=options.reconcile,
        sequential=options.sequential,
        repeatable=options.repeatable,
        needs_approval=options.needs_approval,
    )


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _type_hints(function: _Function, label: str, *, explicit_schema: bool) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception as err:
        if not explicit_schema:
            raise TypeError(
                f"@tool cannot read the type hints of {label} ({type(err).__name__}: {err}); "
                "make them resolvable or pass schema="
            ) from err
        # with an explicit schema the hints only find the ToolContext parameter
        return dict(getattr(function, "__annotations__", {}))


def _is_context(annotation: Any) -> bool:
    if annotation is ToolContext:
        return True
    return isinstance(annotation, str) and annotation.rsplit(".", 1)[-1] == "ToolContext"


def _derived_schema(
    function: _Function,
    label: str,
    signature: inspect.Signature,
    hints: Mapping[str, Any],
    context_name: str | None,
) -> tuple[dict[str, Any], _Conversion]:
    """The JSON schema of the function's arguments (its ToolContext parameter left out), as
    pydantic derives it, and the conversion of checked arguments into the annotated types."""
    try:
        import pydantic
        from pydantic_core import ArgsKwargs
    except ImportError as err:
        raise ImportError(
            f"@tool derives the parameters schema of {label} from its type hints with "
            "pydantic, which is not installed: install toolloop-fsm[pydantic] or pass schema="
        ) from err
    parameters = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in signature.parameters.values()
        if p.name != context_name
    ]

    # pydantic reads a callable's signature and hints; this one stands for the function
    # without its ToolContext parameter and returns the arguments it was called with
    def arguments_of(**arguments: Any) -> dict[str, Any]:
        return arguments

    arguments_of.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    arguments_of.__annotations__ = {
        p.name: p.annotation for p in parameters if p.annotation is not p.empty
    }
    arguments_of.__name__ = arguments_of.__qualname__ = label
    arguments_of.__module__ = getattr(function, "__module__", __name__)
    try:
        # a callable is a valid TypeAdapter subject; typing it as a type form is pydantic's
        # own annotation, which differs between its versions
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(cast(Any, arguments_of))
        schema = adapter.json_schema()
    except pydantic.PydanticUserError as err:
        raise TypeError(
            f"@tool cannot derive a parameters schema for {label}: {err}; pass schema="
        ) from err

    def convert(arguments: dict[str, Any]) -> dict[str, Any] | str:
        try:
            converted: dict[str, Any] = adapter.validate_python(ArgsKwargs((), arguments))
        except pydantic.ValidationError as err:
            # arguments the schema accepted but an annotated validator refuses: told in the
            # schema refusals' form
            return "; ".join(
                f"{'.'.join(['arguments', *map(str, error['loc'])])}: {error['type']} "
                f"({error['msg']})"
                for error in err.errors(include_url=False)
            )
        return converted

    return schema, convert


def _handler_for(
    function: _Function,
    context_name: str | None,
    convert: _Conversion | None,
) -> ToolHandler:
    """The `Tool` handler calling ``function``: ``async`` when the function is, so that it
    runs on the loop, plain otherwise, so that it runs in a worker thread."""

    def keywords(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any] | ToolResult:
        if convert is not None:
            converted = convert(arguments)
            if isinstance(converted, str):  # refused: the model is told why, nothing runs
                return ToolResult(success=False, message=converted)
            arguments = converted
        if context_name is not None:
            arguments = {**arguments, context_name: ctx}
        return arguments

    if runs_on_loop(function):

        async def call_on_loop(arguments: dict[str, Any], ctx: ToolContext) -> Any:
            ready = keywords(arguments, ctx)
            if isinstance(ready, ToolResult):
                return ready
            return await function(**ready)

        return functools.update_wrapper(call_on_loop, function)

    def call_in_thread(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        ready = keywords(arguments, ctx)
        if isinstance(ready, ToolResult):
            return ready
        return function(**ready)

    return functools.update_wrapper(call_in_thread, function)
