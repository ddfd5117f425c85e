"""Markdown table and PNG plots from the suite records in a bench output folder.

``write_report(out_dir)`` reads every ``DIR/<suite>.json`` there and writes:

- ``report.md``: the machine, then one row per headline ratio (ours ÷ the
  baseline a peer system uses), a failed or missing suite shown as its error
  (``suite unavailable: ...``), then each suite's other summary figures and,
  for e2e, one row per run (η, correction, samples/s, score, idle fractions);
  for accuracy, one row per setting (final score and time to target, mean ± std); for
  vs-trl, one row per run (trainer, seed, whole command, time and samples to target).
- ``summary.png``: every headline ratio as a bar (1.0 = parity with the baseline).
- ``<suite>_throughput.png``: throughput against size for each suite that sweeps
  sizes (the record's ``sweep``, see ``bench.common``).
- ``e2e_score.png``: validation score against wall time, one line per η (and the
  bypass-loss run beside the decoupled correction at the largest η).
- ``accuracy_score.png``: held-out score vs step and vs training wall time per
  setting, the mean of seeds with a ± std band (the target score dotted).

Plots use matplotlib's Agg backend (no display). Left out: comparisons across
output folders (each folder is one run on one machine; compare JSONs yourself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.common import read_json, suite_json_path
from fleetrl.log import get_logger

log = get_logger(__name__)

# suite -> [(summary key, what the ratio compares, the baseline's pattern and who uses it)]
HEADLINES: dict[str, list[tuple[str, str, str]]] = {
    "transport": [
        (
            "vs_ray_queue",
            "ZMQ+msgspec trajectories/s ÷ Ray actor queue, one cloudpickled object per group",
            "verl fully-async rollouter -> MessageQueue (one put per prompt's n samples)",
        ),
        (
            "vs_ray_queue_per_sample",
            "ZMQ+msgspec trajectories/s ÷ Ray actor queue, one cloudpickled object per sample",
            "a queue fed sample by sample (per-call overhead x n)",
        ),
        (
            "vs_raw_zmq",
            "ZMQ+msgspec trajectories/s ÷ raw ZMQ bytes of the same payload",
            "transport limit (serialisation overhead)",
        ),
    ],
    "weight-sync": [
        (
            "vs_raw_broadcast",
            "bucketed GB/s ÷ one raw broadcast of the same bytes",
            "transport limit",
        ),
        (
            "vs_per_param",
            "bucketed GB/s ÷ one broadcast per parameter",
            "OpenRLHF, PipelineRL",
        ),
        (
            "full_vs_lora_bytes",
            "full-sync bytes ÷ LoRA adapter-sync bytes (demo model, rank 8, all-linear)",
            "a full sync when only adapters train",
        ),
    ],
    "rollout": [
        (
            "vs_hf_generate",
            "embedded engine tokens/s ÷ transformers generate(num_return_sequences=n), GRPO groups",
            "naive rollout",
        ),
    ],
    "learner": [
        (
            "packed_vs_padded",
            "packed tokens/s ÷ padded micro-batches (median of paired repetitions)",
            "no packing",
        ),
    ],
    "e2e": [
        (
            "async_vs_sync",
            "median over alternated repetitions of samples/s at the declared η ÷ η = 0,"
            " paired per repetition, validation included on both (long-tailed lengths)",
            "synchronous trainer (verl default)",
        ),
    ],
    "accuracy": [
        (
            "time_to_target_vs_sync",
            "time to the target held-out score at η = 0 ÷ at η = 4 (decoupled, mean of seeds)",
            "synchronous trainer (verl default)",
        ),
    ],
    "reward": [
        (
            "batched_vs_per_sample",
            "reward-model samples/s, batched /classify ÷ one /classify request per sample,"
            " same server (median of alternated rounds)",
            "verl's reward loop (one HTTP request per sample)",
        ),
        (
            "model_vs_rule",
            "RL samples/s with reward-model scoring on top of the rule (model weight 0) ÷ rule"
            " scoring alone, paired per alternated repetition (= 1 / (1 + model_scoring_overhead);"
            " goal >= 1 / 1.1)",
            "rule-based rewards only (no reward model)",
        ),
    ],
    "agent": [
        (
            "eta2_vs_eta0",
            "agent episodes/s of the agent demo at η = 2 ÷ at η = 0 (steps after the warm-up),"
            " same resources",
            "synchronous agent rollout (η = 0)",
        ),
    ],
    "vs-trl": [
        (
            "demo_time_to_target_speedup",
            "demo: TRL's training time to held-out 0.9 ÷ fleetrl's at the demo's η (median of"
            " seeds; > 1: fleetrl gets there sooner)",
            "TRL GRPOTrainer, same model, data and hyperparameters",
        ),
        (
            "demo_command_speedup",
            "demo: TRL's whole command ÷ fleetrl's, start to exit (median of seeds)",
            "TRL GRPOTrainer",
        ),
        (
            "demo_sample_efficiency_sync",
            "demo: samples TRL needs to held-out 0.9 ÷ samples fleetrl needs at η = 0",
            "TRL GRPOTrainer (on-policy)",
        ),
        (
            "generation_bound_time_to_target_speedup",
            "generation-bound (long-tailed responses): TRL's training time to the target ÷"
            " fleetrl's",
            "TRL GRPOTrainer (transformers generate)",
        ),
    ],
}
SUITES: tuple[str, ...] = tuple(HEADLINES)
# ``fleetrl bench e2e --placement colocated`` (bench.e2e_placement) measures these instead
PLACEMENT_HEADLINES: list[tuple[str, str, str]] = [
    (
        "colocated_vs_disaggregated",
        "median over alternated repetitions of samples/s with co-located engines ÷ "
        "disaggregated ones on the same resources, at the declared η, paired per repetition",
        "a disaggregated run (engines on their own devices)",
    ),
    (
        "switch_share",
        "median share of a co-located step spent on release + onload + push + resume",
        "0 (no switch)",
    ),
]


# ``fleetrl bench e2e --elastic`` (bench.e2e_elastic) measures these instead
ELASTIC_HEADLINES: list[tuple[str, str, str]] = [
    (
        "join_vs_fixed",
        "samples/s from two versions after engines joined a running job ÷ the same engines "
        "from the start, same steps, median of alternated repetitions (goal >= 0.9)",
        "a fleet of that size from the start",
    ),
    (
        "others_lost_share",
        "generation time the engines already serving lost to the join (pauses beyond the "
        "median, plus the weight group's re-formation) ÷ the wall time of the join (goal <= 0.05)",
        "0 (no join)",
    ),
]


def suite_headlines(suite: str, record: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    """The headline ratios of a suite's record (the placement and elastic comparisons have
    their own)."""
    config = (record or {}).get("config") or {}
    if suite == "e2e" and config.get("elastic"):
        return ELASTIC_HEADLINES
    placement = config.get("placement")
    return PLACEMENT_HEADLINES if suite == "e2e" and placement == "colocated" else HEADLINES[suite]


def load_records(out_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every suite record present in ``out_dir`` (an unreadable file becomes an error record)."""
    records: dict[str, dict[str, Any]] = {}
    for suite in SUITES:
        path = suite_json_path(out_dir, suite)
        if not path.is_file():
            continue
        try:
            records[suite] = read_json(path)
        except (OSError, ValueError) as err:
            records[suite] = {
                "suite": suite,
                "status": "error",
                "error": f"unreadable {path}: {err}",
            }
    return records


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}g}" if abs(value) >= 100 else f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _machine_lines(records: Mapping[str, Mapping[str, Any]]) -> list[str]:
    machine = next((r["machine"] for r in records.values() if r.get("machine")), None)
    if not machine:
        return ["Machine: unknown (no suite recorded it)."]
    versions = machine.get("versions") or {}
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    accel = ", ".join(machine.get("accelerators") or []) or "none"
    return [
        f"Machine: {machine.get('cpu_model')} — {machine.get('cpu_cores_usable')} usable cores"
        f" of {machine.get('cpu_cores')}, {machine.get('memory_gib')} GiB, accelerators: {accel},"
        f" load {machine.get('load_average_1m')} at start.",
        f"Commit {machine.get('git_commit')}; {shown}.",
    ]


def headline_rows(records: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (suite, headline ratio); a missing or failed suite gives rows with its error."""
    rows = []
    for suite in HEADLINES:
        record = records.get(suite)
        for key, meaning, baseline in suite_headlines(suite, record):
            row: dict[str, Any] = {
                "suite": suite,
                "ratio": key,
                "meaning": meaning,
                "baseline": baseline,
                "value": None,
                "status": "not run",
            }
            if record is not None:
                ok = record.get("status", "ok") == "ok"
                row["value"] = (record.get("summary") or {}).get(key)
                row["status"] = "ok" if ok else str(record.get("error") or "error")
                if ok and row["value"] is None:
                    row["status"] = "ratio missing from the suite's summary"
            rows.append(row)
    return rows


def _e2e_lines(record: Mapping[str, Any]) -> list[str]:
    runs = (record.get("results") or {}).get("runs") or []
    if not runs:
        return []
    lines = [
        "",
        "| run | rep | η | correction | samples/s | response tokens/s | final val score | best val score | trainer idle | rollout idle | staleness max | mean response tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            "| "
            + " | ".join(
                fmt(run.get(k))
                for k in (
                    "label",
                    "rep",
                    "eta",
                    "correction",
                    "samples_per_s",
                    "response_tokens_per_s",
                    "final_val_score",
                    "best_val_score",
                    "trainer_idle_fraction",
                    "rollout_idle_fraction",
                    "staleness_max",
                    "response_length_mean",
                )
            )
            + " |"
        )
    return lines


def _accuracy_lines(record: Mapping[str, Any]) -> list[str]:
    settings = (record.get("results") or {}).get("settings") or {}
    if not settings:
        return []
    lines = [
        "",
        "| setting | seeds | final score mean | ± std | time to target (s) | ± std | step to target | reached | samples/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, figures in settings.items():
        values = [
            figures.get(k)
            for k in (
                "seeds",
                "final_score_mean",
                "final_score_std",
                "time_to_target_s_mean",
                "time_to_target_s_std",
                "step_to_target_mean",
                "reached",
                "samples_per_s_mean",
            )
        ]
        lines.append(f"| {key} | " + " | ".join(fmt(v) for v in values) + " |")
    return lines


def _vs_trl_lines(record: Mapping[str, Any]) -> list[str]:
    runs = (record.get("results") or {}).get("runs") or []
    if not runs:
        return []
    keys = ("regime", "arm", "eta", "seed", "command_s", "time_to_target_s",
            "samples_to_target", "samples_per_s", "final_score", "load_before")  # fmt: skip
    lines = [
        "",
        "| regime | trainer | η | seed | whole command (s) | time to target (s) | samples to"
        " target | samples/s | final score | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(fmt(run.get(k)) for k in keys) + " |" for run in runs]
    return lines


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def markdown(records: Mapping[str, Mapping[str, Any]]) -> str:
    """The report: machine, headline ratios, then each suite's other summary figures."""
    lines = ["# fleetrl bench", "", *_machine_lines(records), ""]
    lines += [
        "Each ratio is ours ÷ the baseline, measured side by side in the same run"
        " (> 1 means fleetrl is faster).",
        "",
        "| suite | ratio | value | compares | baseline stands for | status |",
        "|---|---|---|---|---|---|",
    ]
    for row in headline_rows(records):
        status = row["status"] if row["status"] != "ok" else "ok"
        lines.append(
            f"| {row['suite']} | `{row['ratio']}` | {fmt(row['value'])} | {fmt(row['meaning'])}"
            f" | {fmt(row['baseline'])} | {fmt(status)} |"
        )
    for suite in SUITES:
        record = records.get(suite)
        if record is None:
            continue
        headline_keys = {key for key, _, _ in suite_headlines(suite, record)}
        extra = {k: v for k, v in (record.get("summary") or {}).items() if k not in headline_keys}
        lines += ["", f"## {suite}", ""]
        if record.get("status", "ok") != "ok":
            lines.append(f"Error: {fmt(record.get('error'))}")
            continue
        wall = record.get("wall_s")
        config = _flatten(record.get("config") or {})
        shown = ", ".join(f"{k}={v}" for k, v in config.items() if v not in (None, [], {}, ""))
        lines.append(f"Wall time {fmt(wall)} s. Config: {fmt(shown)}.")
        if extra:
            lines += ["", "| figure | value |", "|---|---|"]
            lines += [f"| {k} | {fmt(v)} |" for k, v in extra.items()]
        if suite == "e2e":
            lines += _e2e_lines(record)
        if suite == "accuracy":
            lines += _accuracy_lines(record)
        if suite == "vs-trl":
            lines += _vs_trl_lines(record)
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_summary(records: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Bar per headline ratio; missing ones drawn as an empty slot labelled n/a."""
    plt = _pyplot()
    rows = headline_rows(records)
    labels = [f"{r['suite']}\n{r['ratio']}" for r in rows]
    values = [r["value"] if isinstance(r["value"], int | float) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 4.0))
    bars = ax.bar(range(len(rows)), values, color="tab:blue")
    for bar, row in zip(bars, rows, strict=True):
        text = fmt(row["value"], 2) if row["status"] == "ok" else "n/a"
        ax.annotate(
            text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ours ÷ baseline")
    ax.set_title("fleetrl bench: headline ratios (1.0 = parity)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(suite: str, sweep: Mapping[str, Any], path: Path) -> Path | None:
    """Throughput against size, one line per series (log x when sizes span > 10x)."""
    rows = [r for r in sweep.get("rows") or [] if isinstance(r.get("series"), Mapping)]
    if not rows:
        return None
    plt = _pyplot()
    series_names: list[str] = []
    for row in rows:
        series_names += [n for n in row["series"] if n not in series_names]
    xs = [row["x"] for row in rows]
    numeric_x = all(isinstance(x, int | float) for x in xs)
    positions = xs if numeric_x else list(range(len(xs)))
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for name in series_names:
        points = [
            (p, row["series"][name])
            for p, row in zip(positions, rows, strict=True)
            if isinstance(row["series"].get(name), int | float)
        ]
        if points:
            ax.plot([p for p, _ in points], [v for _, v in points], marker="o", label=name)
    if numeric_x and min(xs) > 0 and max(xs) / min(xs) > 10:
        ax.set_xscale("log")
    if not numeric_x:
        ax.set_xticks(positions, [str(x) for x in xs])
    ax.set_xlabel(str(sweep.get("x", "size")))
    ax.set_ylabel(str(sweep.get("unit", "throughput")))
    ax.set_title(f"{suite}: throughput vs size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e_scores(record: Mapping[str, Any], path: Path) -> Path | None:
    """Validation score against wall time since the run started, one line per run."""
    runs = [r for r in (record.get("results") or {}).get("runs") or [] if r.get("curve")]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    # one colour per η (the repetitions of an η share it), dashed for the bypass loss
    etas = sorted({run.get("eta") for run in runs}, key=lambda e: (e is None, e))
    colours = {eta: f"C{i}" for i, eta in enumerate(etas)}
    for run in runs:
        curve = [(t, s) for t, s in run["curve"] if t is not None and s is not None]
        if not curve:
            continue
        style = "--" if run.get("correction") == "bypass" else "-"
        rep = run.get("rep")
        ax.plot(
            [t for t, _ in curve],
            [s for _, s in curve],
            style,
            color=colours[run.get("eta")],
            marker="o",
            markersize=3,
            alpha=1.0 if not rep else 0.6,
            label=str(run.get("label")) + (f" rep {rep + 1}" if rep is not None else ""),
        )
    ax.set_xlabel("training-loop wall time (s, after start-up)")
    ax.set_ylabel("validation score")
    ax.set_title("e2e: validation score vs wall time per η")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accuracy(record: Mapping[str, Any], path: Path) -> Path | None:
    """Held-out score vs step and vs training wall time, per setting: mean of seeds ± std band."""
    runs = [r for r in (record.get("results") or {}).get("runs") or [] if r.get("curve")]
    if not runs:
        return None
    plt = _pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11.0, 4.2), sharey=True)
    settings: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        name = f"η={run['eta']}" + (" bypass" if run.get("correction") == "bypass" else "")
        settings.setdefault(name, []).append(run)
    for name, mine in settings.items():
        points = min(len(r["curve"]) for r in mine)
        columns = [[r["curve"][i] for r in mine] for i in range(points)]
        mean = [sum(p["score"] for p in col) / len(col) for col in columns]
        spread = [
            (sum((p["score"] - m) ** 2 for p in col) / max(1, len(col) - 1)) ** 0.5
            for col, m in zip(columns, mean, strict=True)
        ]
        low = [m - s for m, s in zip(mean, spread, strict=True)]
        high = [m + s for m, s in zip(mean, spread, strict=True)]
        style = "--" if "bypass" in name else "-"
        for ax, key in ((by_step, "step"), (by_time, "wall_s")):
            xs = [sum(p[key] for p in col) / len(col) for col in columns]
            (line,) = ax.plot(xs, mean, style, marker="o", markersize=3, label=name)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    target = (record.get("summary") or {}).get("target_score")
    for ax in (by_step, by_time):
        if isinstance(target, int | float):
            ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    by_step.set_xlabel("learner step")
    by_time.set_xlabel("training wall time (s; scored from snapshots after the run)")
    by_step.set_ylabel("held-out score (greedy, mean of seeds ± std)")
    by_time.legend()
    fig.suptitle("accuracy: held-out score per staleness bound η (decoupled unless marked)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out_dir: str | Path) -> dict[str, Path]:
    """Write report.md and every plot the records allow; returns {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(out)
    written: dict[str, Path] = {}
    table = out / "report.md"
    table.write_text(markdown(records))
    written["report.md"] = table
    written["summary.png"] = plot_summary(records, out / "summary.png")
    for suite, record in records.items():
        sweep = record.get("sweep")
        if record.get("status", "ok") == "ok" and isinstance(sweep, Mapping):
            path = plot_sweep(suite, sweep, out / f"{suite}_throughput.png")
            if path is not None:
                written[path.name] = path
    e2e = records.get("e2e")
    if e2e is not None and e2e.get("status", "ok") == "ok":
        path = plot_e2e_scores(e2e, out / "e2e_score.png")
        if path is not None:
            written[path.name] = path
    accuracy = records.get("accuracy")
    if accuracy is not None and accuracy.get("status", "ok") == "ok":
        path = plot_accuracy(accuracy, out / "accuracy_score.png")
        if path is not None:
            written[path.name] = path
    log.info("bench report: %s", ", ".join(str(p) for p in written.values()))
    return written
