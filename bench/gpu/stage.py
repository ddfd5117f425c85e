"""One stage of the GPU check, run in a process of its own: the registry and the child side.

    python -m bench.gpu.stage NAME --module bench.gpu.learner --device cuda --work DIR \
        --seconds 90 --result FILE

Each stage is a function ``run(ctx: StageContext) -> None | list[StageResult]`` in its own
module. It writes its figures into ``ctx.figures`` (``ctx.save()`` after each costly part,
so that what was measured survives a time-out), raises ``CheckFailed`` when something it
checks does not hold and ``StageSkipped`` when the machine lacks what it needs; any other
exception fails it with the error's first line (the traceback goes to the stage's log).
A stage that is several stages (the SGLang ones, sharing one server) returns their
results instead.

A process per stage: a stage that hangs in CUDA or a collective can be ended by its
process group, a crash or an out-of-memory error costs that stage only, and each starts
with the device's memory free. ``ctx.deadline`` is when a stage should stop measuring
(its limit less a margin for shutting down); loops repeat until then, at least once.
SIGTERM (the parent's time box) ends a stage through its ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu.report import StageResult, first_line

# A stage's why when the parent's time box stopped it (the parent says which limit)
INTERRUPTED = "stopped by its time limit"
# What a stage keeps of its limit to shut down (engines, Ray) after its deadline.
SHUTDOWN_MARGIN_S = 15.0
SHUTDOWN_SHARE = 0.2


class CheckFailed(Exception):
    """Something the stage checks does not hold (its figures are still reported)."""


class StageSkipped(Exception):
    """The machine lacks what the stage needs (one line saying what)."""


class StageInterrupted(BaseException):
    """SIGTERM from the parent's time box (a BaseException: no broad handler swallows it)."""


@dataclass(frozen=True)
class StageSpec:
    """A stage: its module (``MODULE`` for its ``run``, or ``MODULE:FUNCTION``), its time
    limit per device, and the least time worth starting it in."""

    name: str
    module: str
    limit_s: dict[str, float]
    min_s: float = 20.0
    doc: str = ""
    headline: tuple[str, ...] = ()  # the figures the report's summary lifts


@dataclass
class StageContext:
    name: str
    device: str  # "cuda" or "cpu"
    work: Path  # this stage's scratch folder
    deadline: float  # time.monotonic() by which measuring should stop
    result_path: Path
    options: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Write the figures so far, as still running (the parent reads them even if this
        process is killed before the stage ends)."""
        write_results(self.result_path, [StageResult(self.name, "running", figures=self.figures)])


def write_results(path: Path, results: list[StageResult]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in results], default=str))
    tmp.replace(path)


def read_results(path: Path) -> list[StageResult]:
    if not path.is_file():
        return []
    try:
        return [StageResult.from_dict(d) for d in json.loads(path.read_text())]
    except (ValueError, TypeError, KeyError):
        return []


def deadline_for(seconds: float, started: float) -> float:
    margin = max(SHUTDOWN_MARGIN_S, SHUTDOWN_SHARE * seconds)
    return started + max(seconds - margin, 0.5 * seconds)


def run_in_this_process(ctx: StageContext, target: str) -> list[StageResult]:
    """Run ``target`` (``MODULE`` for its ``run``, or ``MODULE:FUNCTION``); its result(s),
    never raising for a stage error."""
    module, _, function = target.partition(":")
    started = time.monotonic()
    try:
        returned = getattr(importlib.import_module(module), function or "run")(ctx)
        results = returned or [StageResult(ctx.name, "ok", figures=ctx.figures)]
    except CheckFailed as err:
        results = [StageResult(ctx.name, "failed", first_line(str(err)), figures=ctx.figures)]
    except StageSkipped as err:
        results = [StageResult(ctx.name, "skipped", first_line(str(err)), figures=ctx.figures)]
    except StageInterrupted:
        results = [
            StageResult(ctx.name, "failed", "stopped by its time limit", figures=ctx.figures)
        ]
    except Exception as err:  # a stage's error is its result; the traceback goes to its log
        traceback.print_exc()
        why = f"{type(err).__name__}: {first_line(str(err))}"
        results = [StageResult(ctx.name, "failed", why, figures=ctx.figures)]
    for result in results:
        result.seconds = round(time.monotonic() - started, 2)
    return results


def _interrupt(_signum: int, _frame: Any) -> None:
    raise StageInterrupted()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.stage")
    parser.add_argument("name")
    parser.add_argument("--module", required=True, help="MODULE (its run) or MODULE:FUNCTION")
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE")
    args = parser.parse_args(argv)
    started = time.monotonic()
    from fleetrl.log import setup_logging

    setup_logging(f"gpu-check-{args.name}")
    signal.signal(signal.SIGTERM, _interrupt)
    ctx = StageContext(
        name=args.name,
        device=args.device,
        work=Path(args.work),
        deadline=deadline_for(args.seconds, started),
        result_path=Path(args.result),
        options=dict(o.split("=", 1) for o in args.option),
    )
    ctx.work.mkdir(parents=True, exist_ok=True)
    ctx.save()
    results = run_in_this_process(ctx, args.module)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    write_results(ctx.result_path, results)
    return 0


if __name__ == "__main__":
    # run as ``bench.gpu.stage`` (not ``__main__``), so that the exceptions the stage modules
    # raise are the classes ``run_in_this_process`` catches
    from bench.gpu.stage import main as stage_main

    sys.exit(stage_main())
