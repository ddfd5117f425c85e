"""A PEFT LoRA adapter on a tiny model, made with peft directly (what the learner publishes)."""

from __future__ import annotations

import json

import torch


def adapted_model(model_dir: str, *, rank: int = 8, seed: int = 0, target_modules="all-linear"):
    """The tiny model with a LoRA adapter whose A and B are random (B = 0 would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=16, target_modules=target_modules, lora_dropout=0.0)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The adapter in PEFT's saved naming (``get_peft_model_state_dict``)."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model).items())


def adapter_config(model) -> dict:
    """adapter_config.json contents, as ``save_pretrained`` writes them."""
    return json.loads(json.dumps(model.peft_config["default"].to_dict(), default=sorted))


def greedy_with_logprobs(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from a full forward per step."""
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
    return tokens, logprobs
