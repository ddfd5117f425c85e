"""``fleetrl inspect rollouts DIR``: what a rollout bank holds, read-only.

DIR is a run folder (its bank: ``buffer.bank_dir`` from its config.yaml, else
``rollout_bank/``) or a bank folder itself; a folder that is neither is an error, not zeros.

Prints counts (segments, samples, groups complete/partial, hand-outs, commits,
refusals, filter drops), the score distribution (of the samples whose reward was
scored) and the samples whose reward failed, with their most common causes, the
response-length and finish-reason distributions, the share of response tokens the policy produced itself (a
multi-turn response holds tool tokens, loss mask 0), and staleness at hand-out
(learner version of the batch minus the oldest token version of the sample),
read from the bank's segments and its ledger. It never writes to the bank (a torn tail is reported, not repaired).
CLI output, so it prints. Left out: per-data-source breakdowns and plots.

``--json`` prints instead one JSON object per accepted trajectory, in the order the
bank holds them (a row written twice, a resend after a buffer restart, once):
``token_ids`` (prompt then response, the sequence the engines saw), and aligned with
it ``loss_mask`` (1 where the policy generated the token and it trains, 0 on the
prompt and on template, tool and user tokens), ``logprobs`` (the engine's; 0.0 where
the mask is 0) and ``versions`` (the policy version that made each token; -1 on the
prompt); ``prompt_length``, ``reward`` (``null`` when it failed: ``reward_error``
says why), ``episode`` (the agent episode it is a branch of, "" for plain samples),
``uid``, ``group_id``, ``prompt_index``, ``data_source``, ``finish_reason``,
``engine_id``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

from buffer.arrow_batch import (
    arrow_to_trajectories,
    list_column_numpy,
    loss_mask_column,
    reward_error_column,
)
from buffer.bank import (
    LEDGER_NAME,
    CommitMark,
    Dropped,
    Handout,
    Refused,
    ResumeMark,
    Rewind,
    Snapshot,
    VersionMark,
    list_segments,
    read_ledger,
    read_segment,
)

RUN_BANK = "rollout_bank"  # a run folder's bank, unless buffer.bank_dir puts it elsewhere


class BankNotFoundError(ValueError):
    """The folder given to ``inspect rollouts`` is neither a run folder nor a rollout bank."""


def bank_folder(folder: str | Path) -> Path:
    """The rollout bank ``folder`` names: itself when it is one, else its run's bank."""
    root = Path(folder)
    if (root / LEDGER_NAME).exists() or list_segments(root):
        return root
    config = root / "config.yaml"
    if config.is_file():
        import yaml

        bank_dir = ((yaml.safe_load(config.read_text()) or {}).get("buffer") or {}).get("bank_dir")
        if bank_dir:
            return Path(bank_dir)
    return root / RUN_BANK


def _existing_bank(folder: str | Path) -> Path:
    """The bank ``folder`` names (see ``bank_folder``), refused when there is none."""
    given = Path(folder)
    if not given.is_dir():
        raise BankNotFoundError(f"{given.absolute()} is not a folder")
    root = bank_folder(given)
    if not list_segments(root) and not (root / LEDGER_NAME).exists():
        raise BankNotFoundError(
            f"{given.absolute()} holds no rollout bank (no ledger, no segments): give a run "
            f"folder or its {RUN_BANK}/"
        )
    return root


def trajectory_records(bank_dir: str | Path) -> Iterator[dict[str, Any]]:
    """One plain record per accepted trajectory (see ``--json`` in the module docstring)."""
    seen: set[str] = set()
    for _, path in list_segments(_existing_bank(bank_dir)):
        for batch in read_segment(path):
            for traj in arrow_to_trajectories(batch):
                if traj.uid in seen:
                    continue
                seen.add(traj.uid)
                yield _record(traj)


def _record(traj: Any) -> dict[str, Any]:
    prompt = traj.prompt_ids.numpy().tolist()
    response = traj.response_ids.numpy().tolist()
    mask = [1] * len(response) if traj.loss_mask is None else traj.loss_mask.numpy().tolist()
    logprobs = [float(x) for x in traj.behavior_logprobs.numpy()]
    return {
        "uid": traj.uid,
        "group_id": traj.group_id,
        "episode": traj.episode,
        "prompt_index": traj.prompt_index,
        "data_source": traj.data_source,
        "prompt_length": len(prompt),
        "token_ids": prompt + response,
        "loss_mask": [0] * len(prompt) + mask,
        "logprobs": [0.0] * len(prompt)
        + [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
        "versions": [-1] * len(prompt) + traj.token_versions.numpy().tolist(),
        "reward": None if traj.reward_failed else float(traj.score),
        "reward_error": traj.reward_error,
        "finish_reason": traj.finish_reason,
        "engine_id": traj.engine_id,
    }


def summarize(bank_dir: str | Path) -> dict[str, Any]:
    """Every statistic ``inspect rollouts`` prints, as plain data (``bank_dir``: a bank, or a
    run folder holding one)."""
    root = _existing_bank(bank_dir)
    segments = list_segments(root)
    seen: set[str] = set()
    group_size: dict[str, int] = {}
    group_count: Counter[str] = Counter()
    group_min_version: dict[str, int] = {}
    scores, lengths, trained, prompt_lengths, spans = [], [], [], [], []
    finish: Counter[str] = Counter()
    reward_errors: Counter[str] = Counter()
    duplicates = 0
    for _, path in segments:
        for batch in read_segment(path):
            duplicates += _collect_batch(
                batch, seen, group_size, group_count, group_min_version,
                scores, lengths, trained, prompt_lengths, spans, finish, reward_errors,
            )  # fmt: skip
    complete = sum(1 for g, n in group_count.items() if n >= group_size[g])
    ledger = read_ledger(root / LEDGER_NAME)
    handed: list[str] = []
    handout_versions: dict[str, int] = {}
    refused = committed = rewinds = resumes = base = pruned = 0
    dropped: Counter[str] = Counter()
    policy_version = 0
    for rec in ledger:
        if isinstance(rec, Snapshot):  # a pruned bank: hand-outs below base are gone
            base, committed, policy_version = rec.handout_base, rec.committed, rec.version
            pruned, handed = rec.pruned_segments, []
        elif isinstance(rec, Handout):
            del handed[max(0, rec.start - base) :]
            handed.extend(rec.groups)
            handout_versions.update(dict.fromkeys(rec.groups, rec.version))
        elif isinstance(rec, Refused):
            refused += len(rec.groups)
        elif isinstance(rec, Dropped):
            dropped[rec.reason] += len(rec.groups)
        elif isinstance(rec, Rewind):
            rewinds += 1
            del handed[max(0, rec.watermark - base) :]
        elif isinstance(rec, CommitMark):
            committed = max(committed, rec.watermark)
        elif isinstance(rec, VersionMark):
            policy_version = rec.version
        elif isinstance(rec, ResumeMark):
            resumes += 1
            del handed[max(0, rec.watermark - base) :]
            policy_version = rec.version
    staleness = [
        handout_versions[g] - group_min_version[g]
        for g in handed
        if g in group_min_version and group_min_version[g] >= 0
    ]
    return {
        "bank_dir": str(root),
        "segments": len(segments),
        "samples": len(seen),
        "duplicate_rows": duplicates,
        "groups": len(group_count),
        "complete_groups": complete,
        "partial_groups": len(group_count) - complete,
        "handouts": base + len(handed),
        "pruned_segments": pruned,
        "committed_watermark": committed,
        "refused_stale_groups": refused,
        "dropped_groups": dict(dropped),
        "rewinds": rewinds,
        "resumes": resumes,
        "policy_version": policy_version,
        "score": _describe(scores),  # of the samples whose reward was scored
        "reward_failed_samples": sum(reward_errors.values()),
        "reward_errors": dict(reward_errors.most_common(5)),
        "response_length": _describe(lengths),
        # multi-turn: the share of response tokens that are the policy's own (loss mask 1)
        "trained_token_fraction": sum(trained) / max(sum(lengths), 1),
        "prompt_length": _describe(prompt_lengths),
        "finish_reason": dict(finish),
        "staleness_at_handout": _describe(staleness),
        "staleness_histogram": dict(sorted(Counter(staleness).items())),
        "versions_spanned_per_response": _describe(spans),
    }


def _collect_batch(
    batch: pa.RecordBatch,
    seen: set[str],
    group_size: dict[str, int],
    group_count: Counter[str],
    group_min_version: dict[str, int],
    scores: list[float],
    lengths: list[int],
    trained: list[int],
    prompt_lengths: list[int],
    spans: list[int],
    finish: Counter[str],
    reward_errors: Counter[str],
) -> int:
    uids = batch.column("uid").to_pylist()
    gids = batch.column("group_id").to_pylist()
    sizes = batch.column("group_size").to_pylist()
    batch_scores = batch.column("score").to_pylist()
    reasons = batch.column("finish_reason").to_pylist()
    versions, v_off = list_column_numpy(batch, "token_versions")
    _, p_off = list_column_numpy(batch, "prompt_ids")
    loss_mask = loss_mask_column(batch)  # aligned with token_versions (one per response token)
    errors = reward_error_column(batch)
    duplicates = 0
    for i, uid in enumerate(uids):
        if uid in seen:
            duplicates += 1
            continue
        seen.add(uid)
        gid = gids[i]
        group_size.setdefault(gid, sizes[i])
        group_count[gid] += 1
        if errors[i]:  # failed: no score (by the cause's first line, for the summary)
            reward_errors[errors[i].splitlines()[0][:120]] += 1
        else:
            scores.append(batch_scores[i])
        finish[reasons[i]] += 1
        lengths.append(int(v_off[i + 1] - v_off[i]))
        trained.append(int(loss_mask[v_off[i] : v_off[i + 1]].sum()))
        prompt_lengths.append(int(p_off[i + 1] - p_off[i]))
        tokens = versions[v_off[i] : v_off[i + 1]]
        if len(tokens):
            low = int(tokens.min())
            spans.append(int(tokens.max()) - low)
            group_min_version[gid] = min(group_min_version.get(gid, low), low)
    return duplicates


def _describe(values: list[float] | list[int]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "std": float(arr.std()),
        "min": float(arr.min()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "max": float(arr.max()),
    }


def render(summary: dict[str, Any], out: TextIO) -> None:
    def stat(name: str, d: dict[str, float]) -> None:
        if not d.get("count"):
            out.write(f"  {name:<24} (none)\n")
            return
        out.write(
            f"  {name:<24} n={d['count']} mean={d['mean']:.3f} std={d['std']:.3f} "
            f"min={d['min']:g} p50={d['p50']:g} p90={d['p90']:g} max={d['max']:g}\n"
        )

    s = summary
    out.write(f"rollout bank {s['bank_dir']}\n")
    out.write(
        f"  segments {s['segments']} (pruned {s['pruned_segments']}), samples {s['samples']} "
        f"(duplicate rows {s['duplicate_rows']}), groups {s['groups']} "
        f"(complete {s['complete_groups']}, partial {s['partial_groups']})\n"
    )
    out.write(
        f"  hand-outs {s['handouts']} (committed {s['committed_watermark']}), "
        f"refused stale {s['refused_stale_groups']}, dropped {s['dropped_groups'] or 0}, "
        f"rewinds {s['rewinds']}, resumes {s['resumes']}, policy version {s['policy_version']}\n"
    )
    stat("score", s["score"])
    if s["reward_failed_samples"]:
        out.write(
            f"  {'reward failed':<24} {s['reward_failed_samples']} samples "
            f"(most common: {s['reward_errors']})\n"
        )
    stat("response length", s["response_length"])
    out.write(f"  {'trained token fraction':<24} {s['trained_token_fraction']:.3f}\n")
    stat("prompt length", s["prompt_length"])
    out.write(f"  {'finish reasons':<24} {s['finish_reason']}\n")
    stat("staleness at hand-out", s["staleness_at_handout"])
    out.write(f"  {'staleness histogram':<24} {s['staleness_histogram']}\n")
    stat("versions in a response", s["versions_spanned_per_response"])


def main(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "json", False):
            for record in trajectory_records(args.dir):
                sys.stdout.write(json.dumps(record) + "\n")
            return 0
        summary = summarize(args.dir)
    except BankNotFoundError as err:
        print(f"fleetrl: {err}", file=sys.stderr)
        return 2
    render(summary, sys.stdout)
    return 0
