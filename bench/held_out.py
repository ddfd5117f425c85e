"""The shared evaluator of the vs-trl suite: greedy held-out score of a policy folder.

Neither trainer's own code scores its policies: every snapshot, fleetrl's and
TRL's alike, goes through this one function. It renders each held-out prompt with
fleetrl's prompt renderer (``fleetrl.data.reader.render_prompt``, the chat template
both trainers apply), generates greedily with transformers' ``generate`` (left-padded
batches, up to the run's response cap), cuts each response at its first
end-of-sequence token, decodes it without special tokens, and scores it with the
rule scorer of the row's ``data_source`` (``rollout_fleet.rewards.compute_score``,
the demo's rule). The score is the mean over the held-out rows.

Greedy decoding on the CPU in fp32 is deterministic, so two evaluations of one
folder agree exactly; fleetrl's own validation (the embedded engine) agrees with
it on the same folder (``tests/integration/bench/test_vs_trl.py``).
Left out: sampling-based metrics (pass@k).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

BATCH_ROWS = 256  # held-out prompts per generate call


def held_out_rows(files: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every validation row as (messages, data_source, ground_truth)."""
    from fleetrl.data.schema import read_rows

    rows = []
    for file in files:
        for row in read_rows(file):
            rows.append(
                {
                    "messages": [
                        {"role": m["role"], "content": m["content"]} for m in row["prompt"]
                    ],
                    "data_source": row["data_source"],
                    "ground_truth": str(row["reward_model"]["ground_truth"]),
                }
            )
    if not rows:
        raise ValueError(f"held-out evaluation: no rows in {list(map(str, files))}")
    return rows


class HeldOutEvaluator:
    """Scores policy folders on one held-out set (the prompts are rendered once)."""

    def __init__(self, files: Sequence[str | Path], tokenizer_dir: str | Path, max_new_tokens: int):
        from fleetrl.data.reader import render_prompt
        from fleetrl.models.loading import load_tokenizer

        self.rows = held_out_rows(files)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.max_new_tokens = max_new_tokens
        self.prompts = [render_prompt(self.tokenizer, r["messages"], True) for r in self.rows]

    def score(self, model_dir: str | Path) -> float:
        """Mean rule score of the greedy responses of the policy in ``model_dir``."""
        import torch

        from fleetrl.models.loading import load_causal_lm

        model = load_causal_lm(model_dir).eval()
        eos = _eos_ids(model, self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        total = 0.0
        with torch.inference_mode():
            for start in range(0, len(self.prompts), BATCH_ROWS):
                chunk = self.prompts[start : start + BATCH_ROWS]
                ids, mask = _left_padded(chunk, pad)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=self.max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                for offset, row in enumerate(out[:, ids.shape[1] :].tolist()):
                    total += self._score_row(self.rows[start + offset], row, eos)
        return total / len(self.rows)

    def _score_row(self, row: dict[str, Any], response: list[int], eos: list[int]) -> float:
        from rollout_fleet.rewards import compute_score

        cut = next((i for i, t in enumerate(response) if t in eos), len(response))
        text = self.tokenizer.decode(response[:cut], skip_special_tokens=True)
        score = compute_score(row["data_source"], text, row["ground_truth"])
        return float(score["score"] if isinstance(score, dict) else score)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return [int(i) for i in ids if i is not None]


def _left_padded(prompts: list[list[int]], pad: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask
