"""Sharded loading of the checkpoint formats real models ship: bf16 files (read into the fp32
master copy through the staging buffer), tied embeddings, GQA, Llama; one rank, in process."""

from __future__ import annotations

import pytest
import torch

from learner.fsdp import shard_model
from learner.sharded_load import build_sharded


@pytest.mark.parametrize("arch, tied, dtype", [("qwen2", True, torch.bfloat16), ("llama", False, torch.float32)])  # fmt: skip
def test_sharded_load_equals_from_pretrained(tmp_path, group, arch, tied, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = cls(
        vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path)
    model = build_sharded(
        tmp_path, kind="causal_lm", device=torch.device("cpu"),
        shard=lambda m: shard_model(m, bf16=False, cpu_offload=False),
    )  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, local_files_only=True
    )
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    loaded = {n: t.full_tensor() for n, t in model.state_dict().items()}
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    ids = torch.randint(0, 70, (1, 9))
    assert torch.equal(model(ids).logits, reference(ids).logits)
