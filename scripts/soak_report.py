"""The soak's figures: RSS growth per role, disk, throughput drift, the audit, a plot.

Pure functions over the samples scripts/soak.py records (one dict per sampling tick:
``t`` seconds, learner ``step``, ``load`` (1-minute load average), ``roles`` role ->
{pid, rss_mb}, ``disk_mb`` folder -> MiB, ``buffer`` the buffer's counters), plus the
audit of the run directory at the end (``audit``). Growth and drift are measured after
the warm-up: RSS growth is the mean of the last window over the mean of the first window
after warm-up (minus one), so that one noisy sample does not decide it; throughput drift
is samples/s in the last window over the first window after warm-up (minus one).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def windows(samples: list[dict[str, Any]], warmup_s: float, window_s: float) -> list[tuple]:
    """(start, end) of each whole window after the warm-up that the samples cover."""
    if not samples:
        return []
    end = samples[-1]["t"]
    out, start = [], warmup_s
    while start + window_s <= end + 1e-6:
        out.append((start, start + window_s))
        start += window_s
    return out


def _in(samples: list[dict[str, Any]], window: tuple) -> list[dict[str, Any]]:
    return [s for s in samples if window[0] <= s["t"] <= window[1]]


def _step_at(samples: list[dict[str, Any]], t: float) -> tuple[float, int]:
    """The last sample at or before ``t``: (its time, its step)."""
    before = [s for s in samples if s["t"] <= t + 1e-6] or samples[:1]
    return before[-1]["t"], before[-1]["step"]


def _cpu_between(samples: list[dict[str, Any]], t0: float, t1: float) -> float | None:
    """CPU seconds all roles used between the samples at ``t0`` and ``t1`` (same pids)."""
    at = {s["t"]: s for s in samples}
    if t0 not in at or t1 not in at:
        return None
    total = 0.0
    for role, info in at[t1]["roles"].items():
        before = at[t0]["roles"].get(role, {})
        if before.get("pid") != info.get("pid") or None in (before.get("cpu_s"), info.get("cpu_s")):
            return None  # a restarted or vanished role: not comparable
        total += info["cpu_s"] - before["cpu_s"]
    return total


def summarize(
    samples: list[dict[str, Any]], *, samples_per_step: int, warmup_s: float, window_s: float
) -> dict[str, Any]:
    wins = windows(samples, warmup_s, window_s)
    throughput = []
    for win in wins:
        t0, s0 = _step_at(samples, win[0])
        t1, s1 = _step_at(samples, win[1])
        rate = (s1 - s0) * samples_per_step / (t1 - t0) if t1 > t0 else 0.0
        loads = [s["load"] for s in _in(samples, win)]
        cpu = _cpu_between(samples, t0, t1)
        done = (s1 - s0) * samples_per_step
        throughput.append(
            {"start_s": win[0], "end_s": win[1], "steps": s1 - s0, "samples_per_s": rate,
             "load_mean": statistics.fmean(loads) if loads else None,
             "cpu_s_per_ksample": cpu / done * 1000 if cpu is not None and done else None}
        )  # fmt: skip
    drift = cpu_drift = None
    if len(throughput) >= 2 and throughput[0]["samples_per_s"] > 0:
        drift = throughput[-1]["samples_per_s"] / throughput[0]["samples_per_s"] - 1
    if len(throughput) >= 2 and throughput[0]["cpu_s_per_ksample"]:
        last_cpu = throughput[-1]["cpu_s_per_ksample"]
        cpu_drift = None if last_cpu is None else last_cpu / throughput[0]["cpu_s_per_ksample"] - 1
    roles: dict[str, Any] = {}
    for role in sorted({r for s in samples for r in s["roles"]}):
        pids = []
        for s in samples:
            pid = s["roles"].get(role, {}).get("pid")
            if pid is not None and (not pids or pids[-1] != pid):
                pids.append(pid)
        series = [(s["t"], s["roles"][role]["rss_mb"]) for s in samples if role in s["roles"]]
        series = [(t, v) for t, v in series if v is not None]

        def mean_in(win: tuple, series: list = series) -> float | None:
            vals = [v for t, v in series if win[0] <= t <= win[1]]
            return statistics.fmean(vals) if vals else None

        first = mean_in(wins[0]) if wins else None
        last = mean_in(wins[-1]) if wins else None
        after = [v for t, v in series if t >= warmup_s]
        roles[role] = {
            "restarts": max(0, len(pids) - 1),
            "rss_start_mb": series[0][1] if series else None,
            "rss_warm_mb": first,
            "rss_last_mb": last,
            "rss_max_after_warmup_mb": max(after) if after else None,
            "growth": None if not first or last is None else last / first - 1,
        }
    disks = {}
    for name in sorted({d for s in samples for d in s.get("disk_mb", {})}):
        series = [s["disk_mb"].get(name, 0.0) for s in samples]
        after = [s["disk_mb"].get(name, 0.0) for s in samples if s["t"] >= warmup_s]
        disks[name] = {
            "max_mb": max(series) if series else 0.0,
            "last_mb": series[-1] if series else 0.0,
            "max_after_warmup_mb": max(after) if after else None,
            "first_after_warmup_mb": after[0] if after else None,
        }
    loads = [s["load"] for s in samples]
    return {
        "throughput": throughput,
        "throughput_drift": drift,
        "cpu_per_sample_drift": cpu_drift,
        "roles": roles,
        "disk": disks,
        "load_mean": statistics.fmean(loads) if loads else None,
        "load_max": max(loads) if loads else None,
        "steps": samples[-1]["step"] if samples else 0,
    }


def audit(run_dir: Path, margin: int) -> dict[str, Any]:
    """Samples lost and duplicated, read from the run directory after the run ended.

    Trained: every group in ``trained_groups.jsonl`` (a group twice = duplicated). Waiting:
    every group with samples in the bank's remaining segments. A prompt started (index below
    the highest one seen) that is neither is lost, unless it is within ``margin`` of the
    frontier (in flight when the run stopped: the final checkpoint lists it for regeneration).
    """
    from buffer.bank import list_segments, read_segment

    trail_path = run_dir / "trained_groups.jsonl"
    trained: list[str] = []
    for line in trail_path.read_text().splitlines() if trail_path.exists() else []:
        trained += json.loads(line)["groups"]
    waiting: set[str] = set()
    for _, path in list_segments(run_dir / "rollout_bank"):
        for batch in read_segment(path):
            waiting.update(batch.column("group_id").to_pylist())
    fuzz = sorted(g for g in {*trained, *waiting} if g.startswith("fuzz"))

    def index(gid: str) -> int | None:
        head = gid[1:].split("-")[0]
        return int(head) if gid.startswith("p") and head.isdigit() else None

    seen = {i for g in {*trained, *waiting} if (i := index(g)) is not None}
    frontier = max(seen) if seen else -1
    missing = sorted(set(range(frontier + 1)) - seen)
    lost = [i for i in missing if i < frontier - margin]
    return {
        "trained_groups": len(trained),
        "duplicated_groups": len(trained) - len(set(trained)),
        "waiting_groups": len(waiting - set(trained)),
        "frontier_prompt": frontier,
        "in_flight_at_stop": len(missing) - len(lost),
        "lost_groups": len(lost),
        "lost_prompt_indexes": lost[:20],
        "fuzz_groups_accepted": len(fuzz),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render_markdown(report: dict[str, Any]) -> str:
    s, a, f = report["summary"], report["audit"], report["fuzz"]
    lines = [
        f"# Soak: {report['minutes']:.1f} minutes of `{report['config']}`",
        "",
        f"Overrides: `{' '.join(report['overrides'])}`",
        "",
        f"{s['steps']} learner steps ({report['samples_per_step']} samples each); run exit "
        f"status {report['exit_status']}; warm-up {report['warmup_s'] / 60:.0f} min, windows "
        f"of {report['window_s'] / 60:.1f} min; machine: {report['cpus']} CPUs shared, "
        f"load average mean {_num(s['load_mean'])}, max {_num(s['load_max'])}.",
        "",
        "## Memory per role (RSS)",
        "",
        "| role | restarts | at start (MiB) | first window after warm-up | last window | "
        "growth | max after warm-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for role, r in s["roles"].items():
        lines.append(
            f"| {role} | {r['restarts']} | {_mb(r['rss_start_mb'])} | {_mb(r['rss_warm_mb'])} | "
            f"{_mb(r['rss_last_mb'])} | {_pct(r['growth'])} | {_mb(r['rss_max_after_warmup_mb'])} |"
        )
    lines += ["", "## Disk", "", "| folder | after warm-up (MiB) | max after warm-up | last |",
              "|---|---|---|---|"]  # fmt: skip
    for name, d in s["disk"].items():
        lines.append(
            f"| {name} | {_mb(d['first_after_warmup_mb'])} | {_mb(d['max_after_warmup_mb'])} | "
            f"{_mb(d['last_mb'])} |"
        )
    lines += ["", "## Throughput", "",
              "| window (min) | steps | samples/s | CPU s per 1k samples (all roles) | load avg |",
              "|---|---|---|---|---|"]  # fmt: skip
    for w in s["throughput"]:
        load = "-" if w["load_mean"] is None else f"{w['load_mean']:.2f}"
        cpu = w.get("cpu_s_per_ksample")
        lines.append(
            f"| {w['start_s'] / 60:.1f}-{w['end_s'] / 60:.1f} | {w['steps']} | "
            f"{w['samples_per_s']:.1f} | {'-' if cpu is None else f'{cpu:.1f}'} | {load} |"
        )
    lines += [
        "",
        f"Throughput drift (last window vs first after warm-up): {_pct(s['throughput_drift'])}; "
        f"CPU time per sample, same windows: {_pct(s.get('cpu_per_sample_drift'))}",
        "",
        "## Fuzzed frames and the audit",
        "",
        f"- fuzzed messages sent: {f['total']} (ingest {f['ingest']}, control {f['control']}; "
        f"{f['would_block']} not sent while the buffer applied backpressure); by kind: "
        + ", ".join(f"{k} {v}" for k, v in sorted(f["by_kind"].items())),
        f"- buffer counted rejected frames: {f['buffer_rejected']} "
        + ", ".join(f"{k} {int(v)}" for k, v in sorted(f["buffer_rejected_by_reason"].items())),
        f"- buffer restarts (crashes): {s['roles'].get('buffer', {}).get('restarts', 'n/a')}; "
        f"fuzz groups accepted: {a['fuzz_groups_accepted']}",
        f"- groups trained {a['trained_groups']}, duplicated {a['duplicated_groups']}, "
        f"lost {a['lost_groups']}, waiting in the bank at the end {a['waiting_groups']}, "
        f"in flight at the stop {a['in_flight_at_stop']}",
        f"- buffer at the end: {report['buffer_end']}",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    ts = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for role in report["summary"]["roles"]:
        pts = [(s["t"] / 60, s["roles"][role]["rss_mb"]) for s in samples if role in s["roles"]]
        pts = [(t, v) for t, v in pts if v is not None]
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], label=role)
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend(fontsize=7, ncol=3)
    for name in report["summary"]["disk"]:
        axes[1].plot(ts, [s["disk_mb"].get(name, 0.0) for s in samples], label=name)
    axes[1].set_ylabel("disk (MiB)")
    axes[1].legend(fontsize=7)
    tp = report["summary"]["throughput"]
    axes[2].step([w["end_s"] / 60 for w in tp], [w["samples_per_s"] for w in tp], where="pre",
                 label="samples/s (window)")  # fmt: skip
    axes[2].set_ylabel("samples/s")
    load_ax = axes[2].twinx()
    load_ax.plot(ts, [s["load"] for s in samples], color="grey", alpha=0.6, label="load avg")
    load_ax.set_ylabel("load average (1 min)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.axvline(report["warmup_s"] / 60, color="k", linestyle=":", linewidth=0.8)
    fig.suptitle(
        f"fleetrl soak: {report['minutes']:.0f} min, {report['fuzz']['total']} fuzzed frames"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
