"""Scorer of the synthetic tasks (``synth/<task>``, see ``fleetrl.data.synth``).

Exact match, precisely: the completion is cut at the first end-of-turn marker
(``END_MARKERS``; engines usually stop there and may or may not include it in
the text), stripped of surrounding whitespace, and must EQUAL the ground truth.
"8" and " 8\\n" score 1 for "8"; "89", "8 9", "8+1" and "" score 0. A prefix
match would reward run-on answers and a tiny model would learn to pad them.
"""

from __future__ import annotations

from typing import Any

END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "<eos>")


def final_text(solution_str: str) -> str:
    """The completion up to its first end-of-turn marker, stripped."""
    cut = len(solution_str)
    for marker in END_MARKERS:
        position = solution_str.find(marker)
        if position != -1:
            cut = min(cut, position)
    return solution_str[:cut].strip()


def compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    correct = final_text(solution_str) == ground_truth.strip()
    return {"score": float(correct), "acc": float(correct)}
