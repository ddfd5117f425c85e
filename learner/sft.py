"""Supervised warm start: fine-tune a local Hugging Face causal LM on (prompt, answer) pairs.

Used to give the CPU demo's tiny model a starting point from which RL, not
supervision, does the learning: with ``label_noise`` a fraction of the answers
is replaced by a wrong "off by one" answer (an integer answer becomes answer+1),
so the warm-started model has the format and the arithmetic circuitry but
mostly the wrong mapping (DESIGN §8). Single process, plain PyTorch: it is a
set-up step, not part of the distributed learner.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

from fleetrl.log import get_logger
from fleetrl.models.config import WarmStartConfig

log = get_logger(__name__)


def corrupt_answer(answer: str) -> str:
    """The deliberately wrong label: integer answers shifted by one, others reversed."""
    try:
        return str(int(answer) + 1)
    except ValueError:
        return answer[::-1] + "?" if answer else "?"


Row = tuple[list[int], list[int]]  # (input ids, labels: -100 where no loss)


def supervised_warmstart(
    model_dir: str | Path,
    examples: Sequence[tuple[list[dict[str, str]], str]],
    cfg: WarmStartConfig,
    device: str = "cpu",
) -> float:
    """Train ``model_dir`` in place on chat ``examples`` (messages, answer) on ``device``
    (the run's: a GPU run's demo model warm-starts in seconds there); return the last loss."""
    from fleetrl.models.loading import load_tokenizer

    if not examples:
        raise ValueError("supervised warm start needs at least one example")
    tok = load_tokenizer(model_dir)
    prompts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in examples
    ]
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]

    def draw(rng: random.Random) -> Row:
        i = rng.randrange(len(examples))
        answer = examples[i][1]
        if rng.random() < cfg.label_noise:
            answer = corrupt_answer(answer)
        answer_ids = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
        return prompt_ids[i] + answer_ids, [-100] * len(prompt_ids[i]) + answer_ids

    return supervised_warmstart_rows(model_dir, draw, cfg, device)


def supervised_warmstart_rows(
    model_dir: str | Path,
    draw: Callable[[random.Random], Row],
    cfg: WarmStartConfig,
    device: str = "cpu",
) -> float:
    """Train ``model_dir`` in place on rows ``draw(rng)`` makes (ids and labels, e.g. a whole
    agent conversation with loss on the assistant turns only); return the last loss."""
    import torch

    from fleetrl.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).to(device)
    model.train()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loss_value = float("nan")
    for step in range(cfg.steps):
        rows, labels = zip(*(draw(rng) for _ in range(cfg.batch_size)), strict=True)
        width = max(map(len, rows))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # GPT-2: none
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
        label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels], device=device)
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)  # fmt: skip
        loss = model(
            input_ids=input_ids, attention_mask=attention, labels=label_ids, use_cache=False
        ).loss  # no KV cache in training
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())  # a scalar off the graph: no requires_grad warning
        if (step + 1) % 100 == 0:
            log.debug("warm start step %d/%d loss %.4f", step + 1, cfg.steps, loss_value)
    model.to("cpu").save_pretrained(model_dir)
    return loss_value
