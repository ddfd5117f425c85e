"""End-of-run report: the validation-score curve as a PNG and a before/after summary.

Reads ``metrics.jsonl`` (the run's record), so it also works on a finished or
resumed run directory. matplotlib runs headless (the Agg canvas).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.sample_account import account_line
from launcher.tracking import read_metrics


def score_curve(
    metrics: list[dict[str, Any]],
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(validation points, training-score points) as (step, score) pairs."""
    val = [
        (r["step"], r["val/score/mean"])
        for r in metrics
        if isinstance(r.get("val/score/mean"), int | float)
    ]
    train = [
        (r["step"], r["critic/score/mean"])
        for r in metrics
        if isinstance(r.get("critic/score/mean"), int | float)
    ]
    return val, train


def write_score_plot(metrics_path: Path, out_png: Path, title: str = "fleetrl") -> Path:
    """The curve as a PNG. matplotlib's object API, no pyplot state: safe in a thread (the
    training command draws it while its roles shut down)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    val, train = score_curve(read_metrics(metrics_path))
    fig = Figure(figsize=(6.4, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if train:
        ax.plot(
            *zip(*train, strict=True), color="#9db4d0", lw=1.2, label="train reward (sampled, T=1)"
        )
    if val:
        ax.plot(
            *zip(*val, strict=True),
            color="#1f4e8c",
            lw=2.2,
            marker="o",
            label="held-out score (greedy)",
        )
    ax.set_xlabel("learner step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def _score_line(what: str, before: float | None, after: float | None, step: Any) -> str | None:
    """Only what was measured: before -> after, or the one of them validation ran for."""
    if before is not None and after is not None:
        return f"{what}: {before:.3f} -> {after:.3f} ({after - before:+.3f})"
    if before is not None:
        return f"{what} before training: {before:.3f} (not validated after a step: trainer.test_freq)"  # fmt: skip
    if after is not None:
        return f"{what} after step {step}: {after:.3f}"
    return None


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run lines ``fleetrl train`` prints: only scores it measured."""
    step = summary.get("final_val_step", "?")
    scores = [
        _score_line(
            "held-out score", summary.get("initial_val_score"), summary.get("final_val_score"), step
        ),  # fmt: skip
        # a reward model scored: the rule apart
        _score_line(
            "held-out rule score",
            summary.get("initial_val_rule_score"),
            summary.get("final_val_rule_score"),
            step,
        ),  # fmt: skip
    ]
    lines = [line for line in scores if line is not None]
    if "samples" in summary and summary.get("train_wall_s"):
        lines.append(
            f"trained on {summary['samples']} samples in {summary['train_wall_s']:.0f}s "
            f"({summary['samples'] / summary['train_wall_s']:.1f} samples/s); whole run {summary['wall_s']:.0f}s"
        )
    if summary.get("sample_account"):
        lines.append(account_line(summary["sample_account"]))
    if summary.get("plot"):
        lines.append(f"score curve: {summary['plot']}")
    lines.append(f"run directory: {summary['run_dir']}")
    return lines
