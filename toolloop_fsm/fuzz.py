"""Fuzzing a policy with the library's own Hypothesis strategies (`toolloop-fsm fuzz`).

Each example is a whole simulated turn on a virtual clock: a random script (inner tier) or a
random fallback chain (outer tier) run under the policy being fuzzed, then checked against
the invariants of docs/invariants.md. An invariant that breaks — or policy code that raises — is
shrunk by Hypothesis to the shortest failing example, reported with its trace, the seed that
reproduces it and the frames of the policy's own code the exception came through. The report
counts the examples (up to the first failure) apart from the turns run while shrinking it,
and names the declared transitions no turn took. Needs Hypothesis
(``pip install "toolloop-fsm[test]"``).

The inner tier has Hypothesis draw a batch of compact seeds per Hypothesis example
(`toolloop_fsm.testing.seeds`), each expanded in plain Python into the script
`turn_scripts()` would build: Hypothesis's own cost per example is shared by the batch, so
the turns a second are not bound by it. The turns of a batch run in order on one event loop,
each under the time limit; the first that fails fails the batch, and Hypothesis shrinks the
batch to that one turn and its seed to the simplest that still fails. The outer tier draws
one chain per example with `generation_chains()`.

A policy with drafting or the tool checkpoint on is fuzzed with a scripted reviewer whose
answers are drawn too (passes, revisions, no verdict, hangs, raises, slow answers);
``drafting=True`` fuzzes any policy that way, with drafting and the checkpoint switched on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from types import FrameType
from typing import Any

import attrs
from attrs import define
from attrs import field
from attrs import frozen

from toolloop_fsm.policy import LoopPolicy
from toolloop_fsm.policy import TurnPolicy
from toolloop_fsm.result import TraceStep
from toolloop_fsm.stepping import Coverage


class FuzzSetupError(Exception):
    """The fuzz run could not start (bad ``--policy``, Hypothesis missing, …)."""


class PolicyCodeError(Exception):
    """The policy's own code raised before any turn ran — importing the module ``--policy``
    names, or calling the factory it names: a failure of the policy, reported like one a
    turn found (``failure`` is the exception, ``frames`` say where it came from)."""

    def __init__(self, doing: str, err: Exception) -> None:
        super().__init__(f"{doing} raised before any turn ran")
        self.failure = f"{type(err).__name__}: {err}"
        self.frames = users_frames(err)


class ExampleTimeLimitExceeded(Exception):
    """One example ran past the per-example time limit: code it runs (the policy's own
    rules, most likely) hangs. The message names where it was interrupted."""


#: Real seconds one example may run by default; a whole turn takes milliseconds.
EXAMPLE_TIME_LIMIT = 5.0
#: The limit while shrinking an example that hung (each shrink step would otherwise wait out
#: the whole limit).
HUNG_SHRINK_LIMIT = 0.2
#: How many shrink steps may hang again before shrinking stops at the smallest turn found to
#: hang so far (each such step costs the shrink limit: a policy that always hangs would make
#: shrinking take half a minute).
HUNG_SHRINK_STEPS = 30


def load_policy(spec: str, tier: str) -> LoopPolicy | TurnPolicy:
    """``module:attr`` → the policy it names (an instance, or a factory called without
    arguments). The inner tier takes a `LoopPolicy` (or a `TurnPolicy`'s ``loop``); the outer
    tier takes a `TurnPolicy` (a `LoopPolicy` is wrapped in one)."""
    value = _named_value(spec)
    as_tier = _as_inner_policy if tier == "inner" else _as_outer_policy
    policy = as_tier(value)
    if policy is None:
        raise FuzzSetupError(
            f"{spec} is a {type(value).__name__}, not a LoopPolicy or TurnPolicy (or a factory)"
        )
    return policy


def _named_value(spec: str) -> Any:
    """What ``module:attr`` names, imported as ``python -m`` would, a factory called."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FuzzSetupError(f"--policy takes module:attr, got {spec!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # as `python -m` does: a policy module in the current directory can be named
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise FuzzSetupError(f"cannot import {module_name!r}: {err}") from None
    except Exception as err:
        raise PolicyCodeError(f"importing {module_name}", err) from err
    try:
        value: Any = module
        for part in attr.split("."):
            value = getattr(value, part)
    except AttributeError:
        raise FuzzSetupError(f"{module_name!r} has no attribute {attr!r}") from None
    if callable(value) and not isinstance(value, LoopPolicy | TurnPolicy):
        try:
            value = value()
        except Exception as err:
            raise PolicyCodeError(f"the policy factory {spec}", err) from err
    return value


def _as_inner_policy(value: object) -> LoopPolicy | None:
    """The inner tier's policy: a `LoopPolicy`, or a `TurnPolicy`'s ``loop``."""
    if isinstance(value, TurnPolicy):
        return value.loop
    return value if isinstance(value, LoopPolicy) else None


def _as_outer_policy(value: object) -> TurnPolicy | None:
    """The outer tier's policy: a `TurnPolicy`, or a `LoopPolicy` wrapped in one."""
    if isinstance(value, LoopPolicy):
        return TurnPolicy(loop=value)
    return value if isinstance(value, TurnPolicy) else None


@frozen
class CodeFrame:
    """One frame of the policy's own code an exception passed through: ``file`` (relative to
    the working directory when under it), ``line``, ``function`` and the line's ``source``."""

    file: str
    line: int
    function: str
    source: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def _places(*paths: str) -> tuple[str, ...]:
    return tuple(os.path.join(os.path.abspath(path), "") for path in paths)


#: Where the library and the standard library (the event loop) live, and where installed
#: packages do: none of it is the policy's code.
_LIBRARY = _places(os.path.dirname(__file__), os.path.dirname(os.__file__))
_INSTALLED = _places(*{sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})


def users_frames(err: BaseException) -> tuple[CodeFrame, ...]:
    """The frames of ``err``'s traceback in the policy's own code (outermost first): the
    library's, the standard library's and installed packages' (attrs validating a value) say
    nothing to its author. A policy that is itself an installed package has only installed
    frames: those are kept then."""
    summaries = [
        summary
        for summary in traceback.extract_tb(err.__traceback__)
        if not summary.filename.startswith("<")
        and not os.path.abspath(summary.filename).startswith(_LIBRARY)
    ]
    own = [s for s in summaries if not os.path.abspath(s.filename).startswith(_INSTALLED)]
    cwd = os.path.join(os.getcwd(), "")
    frames = []
    for summary in own or summaries:
        path = os.path.abspath(summary.filename)
        shown = path[len(cwd) :] if path.startswith(cwd) else path
        frames.append(
            CodeFrame(shown, summary.lineno or 0, summary.name, (summary.line or "").strip())
        )
    return tuple(frames)


@frozen
class FuzzFailure:
    """The shortest failing example Hypothesis found: the failing turn's message, trace and
    value (``example``), the turn's compact ``seed`` (inner tier; ``None`` for a chain),
    where it stood in its Hypothesis example: turn ``turn`` of ``batch`` (shrinking leaves
    one turn, unless the batch stopped shrinking early), and the ``frames`` of the policy's
    own code the exception came through (none for a broken invariant)."""

    message: str
    trace: tuple[TraceStep, ...]
    example: str
    seed: bytes | None = None
    turn: int = 1
    batch: int = 1
    frames: tuple[CodeFrame, ...] = ()


@frozen
class FuzzReport:
    """What a fuzz run did: ``examples`` turns generated, run and checked up to and including
    the first that failed (at most the number asked for); ``shrink_runs`` turns run after it
    while Hypothesis searched for the failure's shortest form (shrinking it, and drawing a
    few more turns that may fail more simply); the transitions that fired of those declared;
    and the failure found, if any."""

    examples: int
    seconds: float
    fired: frozenset[str]
    declared: tuple[str, ...]
    seed: int
    failure: FuzzFailure | None = None
    #: the most turns one Hypothesis example carried (1: an example per turn)
    batch_size: int = 1
    shrink_runs: int = 0

    @property
    def unfired(self) -> tuple[str, ...]:
        """The declared transitions no turn took, in declaration order."""
        return tuple(t for t in self.declared if t not in self.fired)

    @property
    def rate(self) -> float:
        """Turns run a second, examples and shrink runs alike."""
        turns = self.examples + self.shrink_runs
        return turns / self.seconds if self.seconds > 0 else 0.0

    @property
    def coverage(self) -> tuple[int, int]:
        return len(self.fired & set(self.declared)), len(self.declared)


@define
class _Progress:
    """Counts the turns run, examples apart from shrink runs (every turn once a failure was
    found); reports after the first, then about once a second."""

    report: Callable[[int, float, int], None] | None
    every: float = 1.0
    started: float = field(factory=time.perf_counter)
    last: float | None = None
    examples: int = 0
    shrink_runs: int = 0

    def tick(self, *, shrinking: bool) -> None:
        if shrinking:
            self.shrink_runs += 1
        else:
            self.examples += 1
        if self.report is None:
            return
        now = time.perf_counter()
        if self.last is None or now - self.last >= self.every:
            self.last = now
            self.report(self.examples, now - self.started, self.shrink_runs)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` real seconds with `ExampleTimeLimitExceeded`,
    naming the line it was running. A policy that spins in a plain loop never yields to the
    event loop, so no asyncio timeout could stop it: a real-time signal can (on the main
    thread of a POSIX process; elsewhere the block runs unlimited)."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def interrupt(_signum: int, frame: FrameType | None) -> None:
        where = "an unknown place"
        if frame is not None:
            code = frame.f_code
            where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        raise ExampleTimeLimitExceeded(
            f"the example ran past the {seconds:g} s time limit, interrupted at {where}: "
            "the policy (or code it calls) hangs"
        )

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fuzz(
    policy: LoopPolicy | TurnPolicy,
    *,
    tier: str = "inner",
    examples: int = 500,
    seed: int = 0,
    progress: Callable[[int, float, int], None] | None = None,
    time_limit: float = EXAMPLE_TIME_LIMIT,
    drafting: bool = False,
) -> FuzzReport:
    """Run ``examples`` random turns under ``policy`` and check the invariants. An example
    running longer than ``time_limit`` real seconds fails, naming where it hung.
    ``drafting`` switches drafting and the tool checkpoint on in ``policy`` (its review
    budgets kept) and draws the reviewer's answers; a policy that has either on already is
    fuzzed with drawn answers either way. ``progress`` is called about once a second with the
    examples run, the seconds taken and the shrink runs."""
    _check_run_settings(examples, time_limit)
    try:
        from hypothesis import HealthCheck
        from hypothesis import Phase
        from hypothesis import given
        from hypothesis import seed as seeded
        from hypothesis import settings
    except ImportError:
        raise FuzzSetupError('fuzzing needs Hypothesis: pip install "toolloop-fsm[test]"') from None
    declared, tier_run = _tier_under(policy, tier, drafting)

    ticker = _Progress(progress)
    findings = _Findings()
    loop = asyncio.new_event_loop()
    fired: set[str] = set()
    previous = Coverage.fired

    def run_turn(case: Any, turn: int, batch: int) -> None:
        # once a turn failed, every turn is Hypothesis's search for its shortest form
        ticker.tick(shrinking=bool(findings.failures))
        if findings.stopped_shrinking:
            return  # not run: the smallest turn that hung so far is the one reported
        value = tier_run.expand(case)
        steps: list[TraceStep] = []
        try:
            with _time_limit(findings.time_limit(time_limit)):
                loop.run_until_complete(tier_run.run(value, steps.append))
        except Exception as err:
            findings.note(
                err,
                tuple(steps),
                tier_run.describe(case, value),
                seed=case if isinstance(case, bytes) else None,
                turn=turn,
                batch=batch,
            )
            raise

    def one_round(round_seed: Hashable, batches: int) -> None:
        @settings(
            max_examples=batches,
            database=None,
            deadline=None,
            derandomize=False,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.generate, Phase.shrink),
        )
        @seeded(round_seed)
        @given(tier_run.batches)
        def property_holds(batch: Sequence[Any]) -> None:
            # the turns run in order; the first that fails fails the batch (and Hypothesis
            # shrinks the batch to it). Shrinking replays batches whatever the budget.
            for turn, case in enumerate(batch, 1):
                if ticker.examples >= examples and not findings.failures:
                    return
                run_turn(case, turn, len(batch))

        property_holds()

    started = time.perf_counter()
    Coverage.fired = fired
    failure: FuzzFailure | None = None
    try:
        _run_rounds(one_round, ticker, examples, seed, tier_run.mean)
    except Exception as err:
        failure = findings.shortest(err)
    finally:
        Coverage.fired = previous
        loop.close()
    return FuzzReport(
        examples=ticker.examples,
        shrink_runs=ticker.shrink_runs,
        seconds=time.perf_counter() - started,
        fired=frozenset(fired),
        declared=declared,
        seed=seed,
        failure=failure,
        batch_size=tier_run.most,
    )


@define
class _Findings:
    """What the turns run so far found: each failure in the order it was found, and the
    reports of the turns that hung."""

    failures: list[FuzzFailure] = field(factory=list)
    hung: list[str] = field(factory=list)

    @property
    def stopped_shrinking(self) -> bool:
        """Too many shrink steps hung again: the smallest turn that hung so far stands."""
        return len(self.hung) > HUNG_SHRINK_STEPS

    def time_limit(self, limit: float) -> float:
        # once one turn hung, shrinking needs only to see which ones still reach the hang
        return limit if not self.hung else min(limit, HUNG_SHRINK_LIMIT)

    def note(
        self,
        err: Exception,
        trace: tuple[TraceStep, ...],
        example: str,
        *,
        seed: bytes | None,
        turn: int,
        batch: int,
    ) -> None:
        message = str(err)
        if isinstance(err, ExampleTimeLimitExceeded):
            self.hung.append(message)
            message = self.hung[0]  # the first report names the full limit
        self.failures.append(
            FuzzFailure(
                f"{type(err).__name__}: {message}",
                trace,
                example,
                seed=seed,
                turn=turn,
                batch=batch,
                frames=users_frames(err),
            )
        )

    def shortest(self, err: Exception) -> FuzzFailure:
        """The failure to report once Hypothesis raised ``err``: it replays the shortest
        failing example last (no failure: the fuzz run itself failed)."""
        if not self.failures:
            raise FuzzSetupError(f"the fuzz run itself failed: {err!r}") from err
        return self.failures[-1]


def _check_run_settings(examples: int, time_limit: float) -> None:
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise FuzzSetupError(f"--examples takes a whole number of at least 1, got {examples!r}")
    if not time_limit > 0 or time_limit == float("inf"):
        raise FuzzSetupError(f"--time-limit takes a positive number of seconds, got {time_limit!r}")


def _tier_under(
    policy: LoopPolicy | TurnPolicy, tier: str, drafting: bool
) -> tuple[tuple[str, ...], _TierRun]:
    """The tier's declared transitions, and how it is fuzzed under ``policy`` (with drafting
    and the tool checkpoint switched on, for ``drafting``)."""
    if tier == "inner":
        from toolloop_fsm import machine

        assert isinstance(policy, LoopPolicy)
        if drafting:
            policy = attrs.evolve(policy, drafting=True, review_tool_calls=True)
        return machine.DECLARATION.transition_ids, _inner(policy)
    if tier == "outer":
        from toolloop_fsm import generation

        assert isinstance(policy, TurnPolicy)
        if drafting:
            reviewed = attrs.evolve(policy.loop, drafting=True, review_tool_calls=True)
            policy = attrs.evolve(policy, loop=reviewed)
        return generation.DECLARATION.transition_ids, _outer(policy)
    raise FuzzSetupError(f"--tier is inner or outer, got {tier!r}")


def _run_rounds(
    one_round: Callable[[Hashable, int], None],
    ticker: _Progress,
    examples: int,
    seed: int,
    mean: int,
) -> None:
    """Run Hypothesis until ``examples`` turns ran (or a round ran none). A batch carries 1
    to `_TierRun.most` turns (as many as half that on average), so the batches one run of
    Hypothesis needs are only estimated: a round that falls short of the examples asked for
    is followed by another, seeded from the same seed."""
    rounds = 0
    while ticker.examples < examples:
        before = ticker.examples
        batches = -(-(examples - before) // mean) + 1
        one_round(seed if rounds == 0 else f"{seed}/{rounds}", batches)
        rounds += 1
        if ticker.examples == before:
            break


@frozen
class _TierRun:
    """How one tier is fuzzed: what Hypothesis draws for an example (a batch of cases, up
    to ``most`` of them, ``mean`` on average), how a case becomes a turn, how the turn is
    run and checked, and how a failing one is described."""

    batches: Any
    most: int
    mean: int
    expand: Callable[[Any], Any]
    run: Callable[[Any, Callable[[TraceStep], None]], Any]
    describe: Callable[[Any, Any], str]


#: Turns one Hypothesis example of the inner tier carries at most. Hypothesis costs a few
#: hundred microseconds per example on top of each seed it draws; a batch of up to 64 seeds
#: (32 on average) makes that a few microseconds a turn.
BATCH_TURNS = 64


def _inner(policy: LoopPolicy) -> _TierRun:
    from toolloop_fsm.testing.harness import run_script
    from toolloop_fsm.testing.seeds import seed_batches
    from toolloop_fsm.testing.seeds import turn_from_seed

    async def run_turn(script: Any, on_step: Callable[[TraceStep], None]) -> None:
        run = await run_script(script, policy, on_step=on_step)
        run.check()

    reviewed = policy.drafting or policy.review_tool_calls

    def describe(seed: bytes, script: Any) -> str:
        # bytes past a seed's end read as zeros: the trailing ones say nothing
        return f"{script!r}\n  (expanded from the seed {seed.rstrip(bytes(1))!r})"

    return _TierRun(
        batches=seed_batches(BATCH_TURNS),
        most=BATCH_TURNS,
        mean=(BATCH_TURNS + 1) // 2,
        expand=lambda seed: turn_from_seed(seed, drafting=reviewed),
        run=run_turn,
        describe=describe,
    )


def _outer(policy: TurnPolicy) -> _TierRun:
    from toolloop_fsm.testing.chains import check_chain_invariants
    from toolloop_fsm.testing.chains import generation_chains
    from toolloop_fsm.testing.chains import run_chain

    async def run_turn(chain: Any, on_step: Callable[[TraceStep], None]) -> None:
        run = await run_chain(chain, policy=policy, on_step=on_step)
        check_chain_invariants(run)

    reviewed = policy.loop.drafting or policy.loop.review_tool_calls
    # one chain per example, drawn with the rich strategy
    return _TierRun(
        batches=generation_chains(drafting=reviewed).map(lambda chain: (chain,)),
        most=1,
        mean=1,
        expand=lambda chain: chain,
        run=run_turn,
        describe=lambda _chain, chain: repr(chain),
    )


def trace_table(
    steps: Sequence[TraceStep], *, timed: bool = False, since: float | None = None
) -> str:
    """A trace as an aligned text table; ``timed`` adds the guard that fired and each step's
    time in seconds since ``since`` (default: the first step with a time; blank for a step
    without one)."""
    rows = [["#", "state", "event", "next state"]]
    rows += [
        [str(i), s.state, s.event if s.detail is None else f"{s.event} ({s.detail})", s.next_state]
        for i, s in enumerate(steps, 1)
    ]
    if timed:
        if since is None:
            since = next((s.at for s in steps if s.at is not None), None)
        rows[0] += ["guard", "time (s)"]
        for row, s in zip(rows[1:], steps, strict=True):
            when = f"{s.at - since:.3f}" if s.at is not None and since is not None else ""
            row += [s.guard or "", when]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
