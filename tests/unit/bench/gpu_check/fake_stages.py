"""Stage functions with known behaviour, for the GPU check's driver tests (run in a child
process by ``bench.gpu.check.run_stage_process``, as real stages are)."""

from __future__ import annotations

import os
import time

from bench.gpu.report import StageResult
from bench.gpu.stage import CheckFailed, StageContext, StageSkipped, write_results


def passes(ctx: StageContext) -> None:
    ctx.figures.update(
        tokens_per_s=1234.5, device=ctx.device, option=ctx.options.get("colocated_push")
    )


def check_fails(ctx: StageContext) -> None:
    ctx.figures["steps"] = 3
    raise CheckFailed("logged 3 steps, not 5\nsecond line")


def raises(ctx: StageContext) -> None:
    raise RuntimeError("engine said no\nsecond line")


def skips(ctx: StageContext) -> None:
    raise StageSkipped("needs a thing this machine lacks")


def hangs_after_a_figure(ctx: StageContext) -> None:
    ctx.figures["measured_before_the_hang"] = 7.0
    ctx.save()
    time.sleep(600)


def crashes_after_a_figure(ctx: StageContext) -> None:
    ctx.figures["measured_before_the_crash"] = 1.0
    ctx.save()
    os._exit(3)


def respects_its_deadline(ctx: StageContext) -> None:
    ctx.figures["seconds_left_at_start"] = ctx.seconds_left()
    while ctx.seconds_left() > 0:
        time.sleep(0.05)


def group_dies_midway(ctx: StageContext) -> list[StageResult]:
    write_results(ctx.result_path, [StageResult("part_one", "ok", figures={"x": 1})])
    os._exit(4)
