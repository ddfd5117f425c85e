"""`fleetrl rm eval`: how a reward-model folder scores preference pairs, or a policy's samples.

``fleetrl rm eval --model DIR --data FILE...`` reads the pairs as training does
(``fleetrl.data.pairs``: the same rendering, EOS and drops), scores both sequences of
each pair with the folder loaded as transformers' ``AutoModelForSequenceClassification``
(what a user or a server loads), and prints ONE JSON line: ``accuracy``, ``chosen_mean``,
``rejected_mean``, ``margin_mean``, ``pairs`` (with ``loss``, ``score_mean``,
``score_std`` and the ``dropped`` counts).

``fleetrl rm eval --model DIR --policy POLICY --prompts FILE`` asks what RL with the
model will lean on: it samples ``--samples`` responses per prompt from the policy
(verl-schema prompt Parquet, the RL data), scores each with the reward model and with
a rule (``--rule FILE[:NAME]``, a reward function with verl's signature; by default the
built-in scorer of each prompt's ``data_source``, ``rollout_fleet.rewards``), and prints ONE JSON line:
``pearson`` and ``spearman`` between the two scores, ``group_agreement`` (over pairs of
samples of one prompt that the rule ranks apart, the fraction the reward model ranks the
same way: what a group-relative advantage needs), ``rule_mean``, ``rm_mean``, ``samples``.

The score is read at each sequence's true last token (its EOS), not through
transformers' pooling, which looks for the last non-pad token and reads the wrong one
when a tokenizer's pad token is its EOS. Single process, no Ray.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fleetrl.log import get_logger

log = get_logger(__name__)

SCORE_BATCH = 64  # sequences per forward


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="reward-model folder (as `fleetrl rm train` writes)")  # fmt: skip
    p.add_argument("--data", nargs="*", default=[], help="preference Parquet file(s) to score")
    p.add_argument("--max-length", type=int, default=0, help="longest sequence in tokens (0 = the model's positions)")  # fmt: skip
    p.add_argument("--no-chat-template", action="store_true", help="join prompt and response as plain text")  # fmt: skip
    p.add_argument("--policy", default="", help="a policy folder whose samples to score (with --prompts)")  # fmt: skip
    p.add_argument("--prompts", default="", help="prompt Parquet (verl schema) for --policy")
    p.add_argument(
        "--rule",
        default="",
        help="FILE[:NAME]: a reward function with verl's signature to judge --policy's samples by "
        "(default: the built-in scorer of each prompt's data_source)",
    )
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (--policy)")
    p.add_argument("--max-prompts", type=int, default=100, help="prompts to sample (--policy)")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="--policy: tokens per sample (default 8)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="--policy: sampling temperature (default 1)"
    )
    p.add_argument("--seed", type=int, default=0, help="--policy: sampling seed (default 0)")


def load_reward_model(folder: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a reward-model folder (checked by ``reward_folder``), eval mode."""
    from transformers import AutoModelForSequenceClassification

    from fleetrl.models.loading import check_model_dir, load_tokenizer
    from fleetrl.models.reward_folder import check_reward_folder

    check_reward_folder(check_model_dir(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True)
    return model.eval(), load_tokenizer(folder)


def score_sequences(model: Any, sequences: list[list[int]] | list[np.ndarray]) -> np.ndarray:
    """The reward model's score of each token sequence, read at its last token."""
    import torch

    backbone = getattr(model, model.base_model_prefix)
    out = np.zeros(len(sequences))
    order = np.argsort([len(s) for s in sequences])  # similar lengths share a batch
    with torch.no_grad():
        for start in range(0, len(order), SCORE_BATCH):
            chunk = order[start : start + SCORE_BATCH]
            width = max(len(sequences[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.tensor(
                    np.asarray(sequences[i], dtype=np.int64)
                )
                mask[row, : len(sequences[i])] = 1
            hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(dim=1) - 1
            scores = model.score(hidden[torch.arange(len(chunk)), last]).float()[:, 0]
            out[chunk] = scores.numpy()
    return out


def eval_pairs(folder: str | Path, files: list[str], *, max_length: int, chat: bool) -> dict[str, Any]:  # fmt: skip
    from fleetrl.data.pairs import PreferencePairs
    from learner.bradley_terry import summarize_pairs

    model, tokenizer = load_reward_model(folder)
    limit = max_length or int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    pairs = PreferencePairs(files, tokenizer, max_length=limit, apply_chat_template=chat)
    chosen = score_sequences(model, [pairs.chosen(i) for i in range(len(pairs))])
    rejected = score_sequences(model, [pairs.rejected(i) for i in range(len(pairs))])
    summary = summarize_pairs(chosen, rejected, pairs.margin)
    import msgspec

    return {**msgspec.to_builtins(summary), "dropped": dict(pairs.dropped)}


def sample_responses(
    policy: str | Path, prompt_file: str, *, count: int, max_prompts: int, max_new_tokens: int,
    temperature: float, seed: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """``count`` responses per prompt from the policy: {group, prompt, response, data_source, ground_truth, extra_info}."""
    import torch

    from fleetrl.data.reader import render_prompt
    from fleetrl.data.schema import read_rows
    from fleetrl.models.loading import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(policy), load_causal_lm(policy).eval()
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    out = []
    for group, row in enumerate(read_rows(prompt_file)[:max_prompts]):
        ids = torch.tensor([render_prompt(tokenizer, row["prompt"], True)] * count)
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=temperature, top_k=0, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
            )[:, ids.shape[1] :]  # fmt: skip
        for tokens in generated.tolist():
            cut = tokens.index(eos) if eos in tokens else len(tokens)
            out.append({
                "group": group, "prompt": row["prompt"], "data_source": row["data_source"],
                "response": tokenizer.decode(tokens[:cut], skip_special_tokens=True),
                "ground_truth": row["reward_model"]["ground_truth"], "extra_info": row["extra_info"],
            })  # fmt: skip
    return out


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation (NaN when either side is constant)."""
    a, b = a - a.mean(), b - b.mean()
    norm = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / norm) if norm > 0 else float("nan")


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their average rank (as Spearman's correlation needs)."""
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    sorted_values = values[order]
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        out[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return out


def agreement(rm: np.ndarray, rule: np.ndarray, groups: np.ndarray) -> float:
    """Over same-group sample pairs the rule ranks apart: the fraction the RM orders alike."""
    agree = total = 0
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        for a in idx:
            for b in idx:
                if rule[a] > rule[b]:
                    total += 1
                    agree += int(rm[a] > rm[b])
    return agree / total if total else float("nan")


def rule_function(spec: str) -> Any:
    """The judge of ``--rule FILE[:NAME]``, or the built-in scorers by data_source."""
    from rollout_fleet.rewards.custom import RewardLoadError, load_custom_reward
    from rollout_fleet.rewards.registry import default_registry

    if not spec:
        return default_registry().compute_score
    path, _, name = spec.partition(":")
    custom = load_custom_reward(path, name or "compute_score")
    if custom.batched or custom.is_async:
        raise RewardLoadError(
            f"--rule {spec}: {custom.name} is batched or async; rm eval calls a rule once per "
            "sample: give a plain compute_score(data_source, solution_str, ground_truth, "
            "extra_info)"
        )
    return custom.fn


def eval_policy_samples(folder: str | Path, args: argparse.Namespace) -> dict[str, Any]:
    from fleetrl.models.reward_input import reward_token_ids

    model, tokenizer = load_reward_model(folder)
    samples = sample_responses(
        args.policy, args.prompts, count=args.samples, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
    )  # fmt: skip
    chat = not args.no_chat_template
    rm = score_sequences(model, [reward_token_ids(tokenizer, s["prompt"], s["response"], apply_chat_template=chat) for s in samples])  # fmt: skip
    judge = rule_function(args.rule)
    rule = []
    for s in samples:
        score = judge(data_source=s["data_source"], solution_str=s["response"], ground_truth=s["ground_truth"], extra_info=s["extra_info"])  # fmt: skip
        rule.append(float(score["score"] if isinstance(score, dict) else score))
    rule = np.asarray(rule)
    groups = np.array([s["group"] for s in samples])
    return {
        "pearson": pearson(rm, rule),
        "spearman": pearson(ranks(rm), ranks(rule)),
        "group_agreement": agreement(rm, rule, groups),
        "rule_mean": float(rule.mean()),
        "rm_mean": float(rm.mean()),
        "samples": len(samples),
    }


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl rm eval``: one JSON line on stdout."""
    from launcher.cli import UsageError

    if bool(args.policy) != bool(args.prompts):
        raise UsageError("--policy and --prompts go together")
    if not args.data and not args.policy:
        raise UsageError("give --data FILE (preference pairs) or --policy DIR --prompts FILE")
    if args.policy:
        result = eval_policy_samples(args.model, args)
    else:
        result = eval_pairs(args.model, args.data, max_length=args.max_length, chat=not args.no_chat_template)  # fmt: skip
    finite = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in result.items()}  # fmt: skip
    print(json.dumps(finite))  # the CLI's result: one line, NaN written as null
    return 0
