"""Every family into the embedded engine: the WeightSender's update lands bit for bit under the
names the model's files give (GPT-NeoX's ``embed_out``, GPT-2's tied head once), and the engine
then serves over HTTP the greedy tokens transformers' own ``generate`` gives for the same
weights and the same chat-templated prompt; a LoRA adapter on GPT-2's ``Conv1D`` layers merges
as peft merges it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fleetrl.models.checkpoint_names import CheckpointNames
from fleetrl.models.tiny import FAMILIES
from rollout_fleet.client import EngineClient, parse_generate_response
from rollout_fleet.engine import server
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import EngineEndpoint, WeightSender
from weight_sync.sources import module_named_tensors

pytestmark = pytest.mark.timeout(300)
NEW_TOKENS = 12
# random tiny models have near-flat logits, where float rounding of different batch shapes
# could flip an argmax; a sharper head makes the comparison test the engine, not float noise
SHARPEN = 30.0


def _prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
        eos_token_id=10**6, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_sync_is_bit_exact_and_greedy_equals_transformers(family, tiny_family):
    from transformers import AutoModelForCausalLM

    from fleetrl.models.loading import load_tokenizer

    folder = tiny_family(family)
    learner = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():  # "trained" weights: every tensor moved, the head sharpened
        for param in learner.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        learner.get_output_embeddings().weight.mul_(SHARPEN)
    engine = server.EmbeddedEngine(str(folder), engine_id=f"fam-{family}", device="cpu")
    url = engine.start_server("127.0.0.1", 0)
    try:
        config = WeightSyncConfig(bucket_mb=0.05, timeout_s=30, verify_tensors=1000, verify_rows=4)
        sent = module_named_tensors(learner)
        names = CheckpointNames.of(learner)
        assert ("embed_out.weight" in dict(sent)) == (family == "gpt_neox")
        with WeightSender(config) as sender:
            sender.connect([EngineEndpoint("embedded", url, None)])
            metrics = sender.publish(sent, 1)
        assert metrics.engines["embedded"].verified
        held = engine.runner.model.state_dict()
        for name, tensor in sent:
            assert torch.equal(held[names.to_module(name)], tensor), name  # bit for bit
        prompt = _prompt(load_tokenizer(folder))

        async def generate():
            async with EngineClient(url) as client:
                params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
                return await client.generate(prompt, params)

        served = parse_generate_response(asyncio.run(generate()))
        assert served.output_ids == _hf_greedy(learner, prompt)
    finally:
        engine.stop()


def test_a_gpt2_lora_adapter_on_conv1d_layers_merges_as_peft_merges_it(tiny_family, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from rollout_fleet.engine.runner import ModelRunner
    from weight_sync.adapters import read_adapter_folder

    folder = tiny_family("gpt2")
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    wrapped.save_pretrained(str(tmp_path / "adapter"))
    merged = wrapped.merge_and_unload().state_dict()
    runner = ModelRunner(folder)
    assert runner.apply_adapter(read_adapter_folder(tmp_path / "adapter")) == 8  # 4 per block
    served = runner.model.state_dict()
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"):
        assert torch.allclose(served[name], merged[name], atol=1e-6), name
