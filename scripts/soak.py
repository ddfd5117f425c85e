"""Soak test: the CPU demo at several times its rate for 30 minutes, fuzzed frames throughout.

    .venv/bin/python scripts/soak.py                          # 30 minutes (the default)
    .venv/bin/python scripts/soak.py --minutes 3 --warmup-min 1 --window-min 0.5 \\
        --out runs/soak_short

It starts ``fleetrl train`` (configs/demo_cpu.yaml with ``SOAK_OVERRIDES``: a bigger
batch and more samples per prompt, checkpoints every few steps so the rollout bank is
pruned as it goes, a disk bound on the bank, two checkpoints kept) as a child process
with an endless ``trainer.total_steps``. Once the run has written
``buffer_addresses.json`` a thread (soak_fuzz.py) sends fuzzed messages to both buffer
sockets (``--fuzz-rate`` a second, loopback only) until the end. Every ``--interval-s``
it records, per role process named in ``roles.json`` (by pid, via psutil), the resident
memory; the size of the run directory, its rollout bank and its checkpoints; the
learner's step (``metrics.jsonl``) and the buffer's counters; the CPU time each role has
used; and the 1-minute load average. The machine is shared: wall-clock throughput is only
comparable under similar load, so the report also gives the CPU seconds the roles spent
per 1,000 samples in each window (what a leak or a growing data structure would raise).

At the end it stops the fuzzer and the run (SIGTERM to the child it started: the run
checkpoints and exits; SIGKILL of that pid after a grace period), audits the run
directory (soak_report.audit: groups trained twice, groups lost, fuzz groups accepted)
and writes ``<out>/soak.json`` (every sample), ``<out>/soak.md`` and ``<out>/soak.png``
(``--png`` to write the figure elsewhere, e.g. docs/images/soak.png). Exit status 0
when the run went the whole time and the audit is clean; the thresholds of the README
(RSS growth < 5 %, drift < 10 %) are reported, not asserted: this machine is shared.

Left out: GPU memory (the CPU demo has none) and open file descriptors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

ENDLESS_STEPS = 10_000_000
STOP_GRACE_S = 180.0
MAX_MESSAGE_BYTES = 64 * 1024  # trajectories of the tiny model are < 2 KiB; keeps "oversized" cheap
# several times the demo's rate: 4x the samples per step (32 prompts x 16 samples) and a
# learner without the proximal-policy recompute; a checkpoint every 5 steps commits and
# prunes the bank, bounded at 64 MiB on disk
SOAK_OVERRIDES = [
    "data.train_batch_size=32",
    "rollout.n=16",
    "rollout.max_concurrent_groups=128",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=5",
    "learner.correction.mode=bypass",  # no recompute of the proximal policy: a faster learner
    "trainer.keep_checkpoints=2",
    "buffer.bank_max_bytes=67108864",
    f"buffer.max_message_bytes={MAX_MESSAGE_BYTES}",
    "logging.console_every=50",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup-min", type=float, default=5.0, help="excluded from growth/drift")
    parser.add_argument("--window-min", type=float, default=5.0, help="throughput/RSS window")
    parser.add_argument("--fuzz-rate", type=float, default=100.0, help="fuzzed messages a second")
    parser.add_argument("--config", default="configs/demo_cpu.yaml")
    parser.add_argument("--out", default="runs/soak", help="report folder (the run goes in run/)")
    parser.add_argument("--png", default="", help="write the figure here too")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    args = parser.parse_args(argv)
    if min(args.minutes, args.interval_s, args.window_min, args.fuzz_rate) <= 0:
        parser.error("--minutes, --interval-s, --window-min and --fuzz-rate must be > 0")
    if args.warmup_min + args.window_min > args.minutes:
        parser.error("--warmup-min + --window-min must fit in --minutes")
    return args


def _rss_mb(psutil: Any, pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _cpu_s(psutil: Any, pid: int) -> float | None:
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return times.user + times.system


def _du_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            # a file removed while we walk (a pruned segment, an old checkpoint) is skipped
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 2**20


class MetricsTail:
    """Reads metrics.jsonl incrementally: the latest learner step and buffer counters."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.step = 0
        self.last: dict[str, Any] = {}

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "actor/pg_loss" in record:
                self.step = max(self.step, int(record["step"]))
                self.last = record


def _stop_run(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # the run checkpoints and stops
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # by the pid we started, nothing else
        proc.wait()


def _sample(
    t: float, metrics: MetricsTail, roster: dict[str, int], run_dir: Path, psutil: Any, fuzzer: Any
) -> dict[str, Any]:
    """One record of the soak: the step, load, each role's memory and CPU, disk, buffer, fuzz."""
    return {
        "t": t,
        "step": metrics.step,
        "load": os.getloadavg()[0],
        "roles": {r: {"pid": p, "rss_mb": _rss_mb(psutil, p), "cpu_s": _cpu_s(psutil, p)}
                  for r, p in roster.items()},
        "disk_mb": {
            "run dir": _du_mb(run_dir),
            "rollout bank": _du_mb(run_dir / "rollout_bank"),
            "checkpoints": _du_mb(run_dir / "checkpoints"),
        },
        "buffer": {k[7:]: v for k, v in metrics.last.items() if k.startswith("buffer/")},
        "fuzz_sent": fuzzer.total if fuzzer else 0,
    }  # fmt: skip


def _fuzz_report(fuzzer: Any, buffer_end: dict[str, Any]) -> dict[str, Any]:
    """What the fuzzer sent (by socket and kind) and what the buffer rejected of it."""
    by_kind: dict[str, int] = {}
    for key, n in (fuzzer.sent if fuzzer else {}).items():
        by_kind[key.split(".")[1]] = by_kind.get(key.split(".")[1], 0) + n
    return {
        "total": fuzzer.total if fuzzer else 0,
        "ingest": sum(n for k, n in (fuzzer.sent if fuzzer else {}).items() if k.startswith("ingest")),
        "control": sum(n for k, n in (fuzzer.sent if fuzzer else {}).items() if k.startswith("control")),
        "would_block": fuzzer.would_block if fuzzer else 0,
        "replies": fuzzer.replies if fuzzer else 0,
        "by_kind": by_kind,
        "buffer_rejected": buffer_end.get("rejected_frames", 0),
        "buffer_rejected_by_reason": {k[16:]: v for k, v in buffer_end.items()
                                      if k.startswith("rejected_frames.")},
    }  # fmt: skip


def _report(
    args: argparse.Namespace,
    overrides: list[str],
    per_step: int,
    exit_status: int | None,
    samples: list[dict[str, Any]],
    fuzzer: Any,
    audit: dict[str, Any],
) -> dict[str, Any]:
    """``soak.json``'s content: the settings, every sample, their summary, audit and fuzz."""
    from soak_report import summarize

    buffer_end = samples[-1]["buffer"] if samples else {}
    return {
        "config": args.config,
        "overrides": overrides,
        "minutes": samples[-1]["t"] / 60 if samples else 0.0,
        "interval_s": args.interval_s,
        "warmup_s": args.warmup_min * 60,
        "window_s": args.window_min * 60,
        "cpus": os.cpu_count(),
        "samples_per_step": per_step,
        "exit_status": exit_status,
        "samples": samples,
        "summary": summarize(samples, samples_per_step=per_step, warmup_s=args.warmup_min * 60,
                             window_s=args.window_min * 60),  # fmt: skip
        "audit": audit,
        "fuzz": _fuzz_report(fuzzer, buffer_end),
        "buffer_end": {k: buffer_end.get(k) for k in (
            "accepted_samples", "refused_stale", "duplicates", "bank_disk_bytes",
            "bank_segments", "pruned_segments", "store_known_uids", "store_known_groups",
            "tracked_handouts", "retention_final_groups", "bank_over_bound",
            "undeliverable_replies")},
    }  # fmt: skip


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from soak_fuzz import FrameFuzzer
    from soak_report import audit, plot, render_markdown

    from launcher.config import load_run_config
    from launcher.supervision import import_psutil

    psutil = import_psutil()
    out = Path(args.out).resolve()
    run_dir = out / "run"
    if run_dir.exists() and any(run_dir.iterdir()):
        print(f"[soak] {run_dir} is not empty: choose another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*SOAK_OVERRIDES, *args.overrides]
    run_overrides = [f"trainer.output_dir={run_dir}", f"trainer.total_steps={ENDLESS_STEPS}"]
    cfg = load_run_config(REPO / args.config, [*overrides, *run_overrides])
    per_step = cfg.data.train_batch_size * cfg.rollout.n
    cmd = [sys.executable, "-m", "launcher.cli", "train", "--config", args.config,
           *overrides, *run_overrides]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log_file = open(out / "train.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    metrics = MetricsTail(run_dir / "metrics.jsonl")
    fuzzer: FrameFuzzer | None = None
    samples: list[dict[str, Any]] = []
    t_zero: float | None = None  # the first learner step: start-up is not steady state
    started = time.monotonic()
    deadline = started + args.minutes * 60 + 600  # the soak clock starts at the first step
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(args.interval_s)
            addresses = run_dir / "buffer_addresses.json"
            if fuzzer is None and addresses.exists():
                where = json.loads(addresses.read_text())
                fuzzer = FrameFuzzer(where["ingest"], where["control"], rate_per_s=args.fuzz_rate,
                                     max_message_bytes=cfg.buffer.max_message_bytes, seed=15)  # fmt: skip
                fuzzer.start()
            metrics.poll()
            roster_path = run_dir / "roles.json"
            if metrics.step == 0 or not roster_path.exists():
                continue
            if t_zero is None:
                t_zero = time.monotonic()
                deadline = t_zero + args.minutes * 60
            roster = json.loads(roster_path.read_text())
            samples.append(
                _sample(time.monotonic() - t_zero, metrics, roster, run_dir, psutil, fuzzer)
            )
            s = samples[-1]
            print(f"[soak] t={s['t']:.0f}s step={s['step']} load={s['load']:.2f} "
                  f"fuzz={s['fuzz_sent']} bank={s['disk_mb']['rollout bank']:.1f}MiB", flush=True)  # fmt: skip
    finally:
        try:
            if fuzzer is not None:
                fuzzer.stop()
                fuzzer.join(10)
        finally:
            _stop_run(proc)
            log_file.close()
    report = _report(args, overrides, per_step, proc.returncode, samples, fuzzer,
                     audit(run_dir, 2 * cfg.rollout.max_concurrent_groups))  # fmt: skip
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    (out / "soak.md").write_text(render_markdown(report))
    plot(report, out / "soak.png")
    if args.png:
        plot(report, Path(args.png))
    print(render_markdown(report))
    a = report["audit"]
    clean = a["duplicated_groups"] == 0 and a["lost_groups"] == 0 and a["fuzz_groups_accepted"] == 0
    whole = bool(samples) and samples[-1]["t"] >= args.minutes * 60 - 2 * args.interval_s
    return 0 if clean and whole else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
