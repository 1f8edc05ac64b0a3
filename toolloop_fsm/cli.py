"""The `toolloop-fsm` command (and `python -m toolloop_fsm`): demo, serve, diagram, fuzz,
trace."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import TextIO
from typing import TypeVar

from toolloop_fsm.demo_http import ServeLimits
from toolloop_fsm.events import FunctionCall
from toolloop_fsm.events import TextDelta
from toolloop_fsm.events import ThoughtDelta
from toolloop_fsm.events import UsageReport
from toolloop_fsm.host import Tool
from toolloop_fsm.host import ToolContext
from toolloop_fsm.host import ToolResult
from toolloop_fsm.host import TurnRequest
from toolloop_fsm.pump import run_tool_loop
from toolloop_fsm.result import Delivered
from toolloop_fsm.result import GenerationTurnResult
from toolloop_fsm.result import Notice
from toolloop_fsm.result import TraceStep

if TYPE_CHECKING:
    from toolloop_fsm.fuzz import CodeFrame


class TracePrinter:
    """Prints transitions and deliveries as they happen, one line each."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def step(self, step: TraceStep) -> None:
        if step.state == step.next_state:
            self.out.write(f"  · {step.state:<24} {step.event}\n")
        else:
            self.out.write(f"  → {step.state:<24} --{step.event}--> {step.next_state}\n")

    def delivery(self, delivered: Delivered) -> None:
        what = repr(delivered.text) if delivered.text is not None else f"[{delivered.expression}]"
        self.out.write(f"  ✉ delivered {what}\n")

    def notice(self, notice: Notice) -> None:
        self.out.write(f"  ! notice {notice.key} {dict(notice.params)}\n")


class PrintingChannel:
    """A channel that prints what the turn delivers."""

    def __init__(self, printer: TracePrinter) -> None:
        self.printer = printer
        self.index = 0

    async def send_text(self, text: str) -> None:
        self.printer.delivery(Delivered(self.index, text=text))
        self.index += 1

    async def send_expression(self, expression: str) -> None:
        self.printer.delivery(Delivered(self.index, expression=expression))
        self.index += 1

    async def send_notice(self, notice: Notice) -> None:
        self.printer.notice(notice)

    async def queue_front(self, stop_message: str) -> None:
        self.printer.out.write(f"  ⏹ queued first: {stop_message!r}\n")


def print_summary(result: GenerationTurnResult, out: TextIO) -> None:
    out.write("\nResult\n")
    out.write(
        f"  status      {result.status.value}"
        + (f" ({result.reason})" if result.reason else "")
        + "\n"
    )
    out.write(f"  final text  {result.final_text!r}\n")
    out.write(f"  passes      {result.iterations}   tool dispatches {result.tool_dispatches}\n")
    for entry in result.history:
        outcome = "ok" if entry.response.success else f"failed: {entry.response.reason}"
        out.write(f"  tool        {entry.call.name}({dict(entry.call.arguments)}) → {outcome}\n")
    usage = result.usage
    out.write(f"  usage       {usage.input_tokens} in / {usage.output_tokens} out\n")


async def scripted_demo(out: TextIO) -> GenerationTurnResult:
    """A scripted turn: text, a tool call, its result, and the final answer."""
    from toolloop_fsm.testing import ScriptedProvider

    async def get_weather(arguments: dict[str, Any], _ctx: ToolContext) -> ToolResult:
        return ToolResult(data={"city": arguments.get("city"), "sky": "clear", "temp_c": 21})

    provider = ScriptedProvider(
        [
            [
                ThoughtDelta("The user wants the weather; call the tool."),
                TextDelta("Let me check "),
                TextDelta("the forecast. "),
                FunctionCall("get_weather", {"city": "Paris"}, "call_1"),
                UsageReport(42, 12),
            ],
            [TextDelta("It's clear and "), TextDelta("21 °C in Paris."), UsageReport(80, 9)],
        ]
    )
    tools = [Tool("get_weather", "Current weather for a city", {"type": "object"}, get_weather)]
    printer = TracePrinter(out)
    out.write("toolloop-fsm demo: a scripted turn with one tool call\n\n")
    result = await run_tool_loop(
        provider,
        tools,
        PrintingChannel(printer),
        TurnRequest([{"role": "user", "content": "What's the weather in Paris?"}]),
        on_step=printer.step,
    )
    print_summary(result, out)
    return result


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    try:
        return version("toolloop-fsm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _writable(path: str) -> str:
    """``path`` if a file can be created there; otherwise a `ValueError` saying why (checked
    before the work, so a long run is not lost to a typo in the directory)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {path}: the directory {directory} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"cannot write {path}: it is a directory")
    return path


_Number = TypeVar("_Number", int, float)


def _above_zero(kind: Callable[[str], _Number]) -> Callable[[str], _Number]:
    """An argparse type: a number of ``kind`` above zero, refused by name otherwise."""

    def parse(text: str) -> _Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolloop-fsm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"toolloop-fsm {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run a full generation turn over HTTP and print every transition",
        description="With no arguments: an embedded OpenAI-compatible server on loopback. "
        "With --base-url and --model: any OpenAI-compatible endpoint.",
    )
    demo.add_argument("--base-url", help="API root of an OpenAI-compatible server (…/v1)")
    demo.add_argument("--model", help="model name at --base-url")
    demo.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the key")
    demo.add_argument("--scripted", action="store_true", help="no HTTP: a scripted provider")
    demo.add_argument(
        "--drafting",
        action="store_true",
        help="hold the reply for a ModelReviewer asking the same server (the embedded one sends "
        "the first draft back once: a revision happens)",
    )
    demo.add_argument("--save-trace", metavar="FILE", help="write the result (and trace) as JSON")

    serve = commands.add_parser(
        "serve",
        help="run the demo's scripted OpenAI-compatible model on 127.0.0.1 until Ctrl-C",
        description="The embedded scripted model of the demo, to try a host against without "
        "a real model: POST /v1/chat/completions (models steady-2 and the rate-limited "
        "swift-1) and GET /v1/models.",
    )
    serve.add_argument(
        "--port",
        type=int,
        default=8765,
        metavar="N",
        help="port on 127.0.0.1 (default 8765; 0 picks a free one)",
    )
    limits = ServeLimits()
    for flag, kind, metavar, meaning in (
        ("--max-connections", int, "N", "connections held at once; one more is answered 503"),
        ("--max-body-bytes", int, "N", "the largest request body; a larger one is answered 413"),
        (
            "--idle-timeout",
            float,
            "SECONDS",
            "how long a connection may wait between requests before it is closed",
        ),
    ):
        default = getattr(limits, flag[2:].replace("-", "_"))  # 15.0 s reads "15"
        serve.add_argument(
            flag,
            type=_above_zero(kind),
            default=None,
            metavar=metavar,
            help=f"{meaning} (default {default:g})"
            if kind is float
            else f"{meaning} (default {default})",
        )

    diagram = commands.add_parser(
        "diagram", help="render a machine's state diagram from its declaration"
    )
    diagram.add_argument("machine", choices=("inner", "outer"))
    diagram.add_argument(
        "--view",
        choices=("full", "exits"),
        default="full",
        help="full: every transition; exits: each way the turn ends, drawn from where it "
        "happens to its terminal state",
    )
    diagram.add_argument("--format", choices=("mermaid", "dot", "svg"), default="mermaid")
    diagram.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    diagram.add_argument(
        "--highlight", metavar="TRACE.json", help="colour the path a saved result or trace took"
    )

    fuzz = commands.add_parser("fuzz", help="fuzz a policy with the library's strategies")
    fuzz.add_argument("--policy", metavar="MODULE:ATTR", help="a LoopPolicy/TurnPolicy or factory")
    fuzz.add_argument("--examples", type=int, default=500, metavar="N")
    fuzz.add_argument("--seed", type=int, default=0, metavar="S")
    fuzz.add_argument("--tier", choices=("inner", "outer"), default="inner")
    fuzz.add_argument(
        "--time-limit",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="real seconds one example may run before it fails as hung (default 5)",
    )
    fuzz.add_argument(
        "--drafting",
        action="store_true",
        help="switch drafting and the tool checkpoint on; the reviewer's answers are drawn",
    )

    trace = commands.add_parser("trace", help="print a saved result's trace as a table")
    trace.add_argument("file", metavar="FILE")
    return parser


def _demo(args: argparse.Namespace) -> int:
    from toolloop_fsm.demo import run_demo
    from toolloop_fsm.demo import unreachable_message

    try:
        save_to = _writable(args.save_trace) if args.save_trace else None
    except ValueError as err:
        sys.stderr.write(f"toolloop-fsm demo: {err}\n")
        return 2
    if args.scripted and args.drafting:
        sys.stderr.write(
            "toolloop-fsm demo: --drafting needs a server to review with, not --scripted\n"
        )
        return 2
    if args.scripted:
        result = asyncio.run(scripted_demo(sys.stdout))
        _save(result, save_to)
        return 0 if result.status.value == "completed" else 1
    if (args.base_url is None) != (args.model is None):
        sys.stderr.write("toolloop-fsm demo: --base-url and --model go together\n")
        return 2
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if api_key is None:
            sys.stderr.write(f"toolloop-fsm demo: ${args.api_key_env} is not set\n")
            return 2
    result = asyncio.run(
        run_demo(
            sys.stdout,
            base_url=args.base_url,
            model=args.model,
            api_key=api_key,
            drafting=args.drafting,
        )
    )
    _save(result, save_to)
    if args.base_url is not None:
        message = unreachable_message(result, args.base_url)
        if message is not None:
            sys.stderr.write(f"toolloop-fsm demo: {message}\n")
            return 2
    return 0 if result.status.value == "completed" else 1


def _save(result: GenerationTurnResult, path: str | None) -> None:
    if path is None:
        return
    from toolloop_fsm.result import result_to_json

    with open(path, "w", encoding="utf-8") as out:
        out.write(result_to_json(result))


def _serve(args: argparse.Namespace) -> int:
    import attrs

    from toolloop_fsm.demo import serve

    if not 0 <= args.port <= 65535:
        sys.stderr.write(f"toolloop-fsm serve: --port takes 0 to 65535, got {args.port}\n")
        return 2
    try:
        given = {
            "max_connections": args.max_connections,
            "max_body_bytes": args.max_body_bytes,
            "idle_timeout": args.idle_timeout,
        }
        limits = attrs.evolve(ServeLimits(), **{k: v for k, v in given.items() if v is not None})
        asyncio.run(serve(sys.stdout, port=args.port, limits=limits))
    except KeyboardInterrupt:
        sys.stdout.write("toolloop-fsm serve: stopped\n")
    except OSError as err:
        sys.stderr.write(
            f"toolloop-fsm serve: cannot listen on 127.0.0.1:{args.port}: {err.strerror}\n"
        )
        return 2
    return 0


def load_saved(path: str) -> GenerationTurnResult | tuple[TraceStep, ...]:
    """A saved result (``result_to_json``) or a bare trace list, checked whole: a file of
    any other shape is a `ValueError` naming it, never an empty table."""
    from toolloop_fsm.result import converter

    data = _read_json(path)
    problem = f"a JSON {type(data).__name__}"
    try:
        if isinstance(data, list):
            return converter.structure(data, tuple[TraceStep, ...])
        if isinstance(data, dict):
            return converter.structure(data, GenerationTurnResult)
    except Exception as err:
        problem = _first_line(err)
    raise ValueError(f"{path} holds neither a saved result nor a trace ({problem})")


def _first_line(err: BaseException) -> str:
    """The first line of a (cattrs) structuring error, without its sub-exception tree."""
    causes = getattr(err, "exceptions", None)
    if causes:
        return _first_line(causes[0])
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_trace(path: str, machine: str) -> tuple[TraceStep, ...]:
    """Steps from a saved result (``result_to_json``) or a bare trace list. For the inner
    machine, a generation turn's result gives the steps of every attempt."""
    saved = load_saved(path)
    if isinstance(saved, tuple):
        return saved
    if machine == "inner" and saved.attempts:
        return tuple(step for attempt in saved.attempts for step in attempt.trace)
    return saved.trace


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as source:
            return json.load(source)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON (not UTF-8 text)") from None
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None


def _diagram(args: argparse.Namespace) -> int:
    from toolloop_fsm.diagrams import DiagramError
    from toolloop_fsm.diagrams import declaration
    from toolloop_fsm.diagrams import render

    try:
        output = _writable(args.output) if args.output else None
        highlight = load_trace(args.highlight, args.machine) if args.highlight else None
        data = render(declaration(args.machine), args.format, view=args.view, highlight=highlight)
    except (DiagramError, ValueError, OSError) as err:
        sys.stderr.write(f"toolloop-fsm diagram: {err}\n")
        return 2
    if output is not None:
        with open(output, "wb") as out:
            out.write(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def _fuzz(args: argparse.Namespace) -> int:
    from toolloop_fsm.fuzz import FuzzSetupError
    from toolloop_fsm.fuzz import PolicyCodeError
    from toolloop_fsm.fuzz import fuzz
    from toolloop_fsm.fuzz import load_policy
    from toolloop_fsm.fuzz import trace_table
    from toolloop_fsm.policy import LoopPolicy
    from toolloop_fsm.policy import TurnPolicy

    def progress(count: int, seconds: float, shrink_runs: int) -> None:
        rate = count / seconds if seconds > 0 else 0.0
        line = f"\r  … {count}/{args.examples} examples, {rate:,.0f}/s"
        if shrink_runs:
            line += f", shrinking ({shrink_runs} runs)"
        elif count < args.examples and rate > 0:
            line += f", ETA {(args.examples - count) / rate:.0f} s"
        sys.stderr.write(line + " " * 8)
        sys.stderr.flush()

    # The fuzzed tools raise and misbehave on purpose, and each such call is a WARNING on the
    # tools' logger for a host to read; here they are not news, and without logging set up
    # they would go to stderr (tracebacks and all) around the report. They still reach any
    # handler above, so the library's own records are still checked for keys.
    quiet = logging.NullHandler()
    tools_logger = logging.getLogger("toolloop_fsm.tools")
    tools_logger.addHandler(quiet)
    try:
        if args.policy:
            policy = load_policy(args.policy, args.tier)
        else:
            policy = LoopPolicy() if args.tier == "inner" else TurnPolicy()
        report = fuzz(
            policy,
            tier=args.tier,
            examples=args.examples,
            seed=args.seed,
            progress=progress,
            time_limit=args.time_limit,
            drafting=args.drafting,
        )
    except PolicyCodeError as err:
        # the policy's own code failed, as a rule failing in a turn does: a finding, not a
        # usage error
        print("\n".join([f"FAILED: {err.failure}", *_frame_lines(err.frames)]))
        print(f"\n{err}")
        return 1
    except FuzzSetupError as err:
        sys.stderr.write(f"toolloop-fsm fuzz: {err}\n")
        return 2
    finally:
        tools_logger.removeHandler(quiet)
    sys.stderr.write("\r" + " " * 72 + "\r")
    fired, declared = report.coverage
    name = args.policy or "the default policy"
    # shrink runs are turns too, but not examples: the count and the rate say which they hold
    shrunk = f" (and {report.shrink_runs} shrink runs)" if report.shrink_runs else ""
    per = "turns" if report.shrink_runs else "examples"
    print(
        f"fuzzed {name} ({args.tier} tier): {report.examples} examples{shrunk} in "
        f"{report.seconds:.1f} s, {report.rate:,.0f} {per}/s"
    )
    # an example here is a turn, not a Hypothesis example: say what the rate counts
    batching = (
        f"Hypothesis drew them as compact seeds, up to {report.batch_size} per Hypothesis example"
        if report.batch_size > 1
        else "one per Hypothesis example"
    )
    print(f"an example is one whole simulated turn, generated, run and checked ({batching})")
    print(f"transition coverage: {fired}/{declared} declared transitions fired")
    if report.unfired:
        print(f"never fired ({len(report.unfired)}):")
        print("\n".join(f"  {transition}" for transition in report.unfired))
    if report.failure is None:
        print("no invariant broke")
        return 0
    failure = report.failure
    print("\n".join(["", f"FAILED: {failure.message}", *_frame_lines(failure.frames)]))
    print(f"\nshortest failing trace ({len(failure.trace)} steps):")
    print(trace_table(failure.trace) if failure.trace else "  (the turn failed before any step)")
    print(f"\nshortest failing example:\n  {failure.example}")
    if failure.batch > 1:
        print(f"  (turn {failure.turn} of the {failure.batch} its Hypothesis example still held)")
    rerun = f"toolloop-fsm fuzz --tier {args.tier} --seed {report.seed} --examples {args.examples}"
    if args.policy:
        rerun += f" --policy {args.policy}"
    if args.drafting:
        rerun += " --drafting"
    print(f"\nreproduce with: {rerun}")
    return 1


def _frame_lines(frames: Sequence[CodeFrame]) -> list[str]:
    """The policy's own frames an exception came through, innermost last, each with its line."""
    lines = []
    for frame in frames:
        lines.append(f"  at {frame}")
        if frame.source:
            lines.append(f"    {frame.source}")
    return lines


def _trace(args: argparse.Namespace) -> int:
    from toolloop_fsm.fuzz import trace_table

    try:
        saved = load_saved(args.file)
    except ValueError as err:
        sys.stderr.write(f"toolloop-fsm trace: {err}\n")
        return 2
    if isinstance(saved, tuple):
        print(trace_table(saved, timed=True))
        return 0
    lines = [f"status: {saved.status.value}" + (f" ({saved.reason})" if saved.reason else "")]
    # every table's times count from the turn's first step
    steps = (*saved.trace, *(step for attempt in saved.attempts for step in attempt.trace))
    since = next((step.at for step in steps if step.at is not None), None)
    lines.append(trace_table(saved.trace, timed=True, since=since))
    for attempt in saved.attempts:
        superseded = " (superseded)" if attempt.superseded else ""
        heading = f"attempt {attempt.index} — {attempt.label}"
        lines.append(f"\n{heading}: {attempt.status.value}{superseded}")
        lines.append(trace_table(attempt.trace, timed=True, since=since))
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "demo": _demo,
        "serve": _serve,
        "diagram": _diagram,
        "fuzz": _fuzz,
        "trace": _trace,
    }
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        # the reader hung up (`| head`): stop quietly, as Unix tools do; point stdout at
        # devnull so the interpreter's own flush at exit does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the pipe


if __name__ == "__main__":
    raise SystemExit(main())
