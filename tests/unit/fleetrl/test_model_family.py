"""A causal LM's layout, read from the model itself: sizes through one normalisation of the
config's names, decoder blocks from ``_no_split_modules``, LoRA targets by the family's own
linear layers, what cannot be trained, and which families keep packed sequences apart."""

from __future__ import annotations

import pytest
import torch

from fleetrl.models.config_sizes import ConfigSizeError, model_sizes
from fleetrl.models.family import (
    architecture_problem,
    block_linear_names,
    decoder_blocks,
    lora_target_problem,
)
from fleetrl.models.tiny import FAMILIES

# config.json as each family writes it (the names differ; GPT-2's omits tie_word_embeddings)
GPT2_JSON = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
             "n_positions": 1024, "vocab_size": 50257}  # fmt: skip
OPT_JSON = {"model_type": "opt", "hidden_size": 768, "num_attention_heads": 12,
            "num_hidden_layers": 12, "ffn_dim": 3072, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": 768}  # fmt: skip
QWEN_JSON = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
             "num_key_value_heads": 4, "num_hidden_layers": 28, "intermediate_size": 18944,
             "vocab_size": 152064, "tie_word_embeddings": False}  # fmt: skip
FALCON_JSON = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71,
               "num_hidden_layers": 32, "multi_query": True, "vocab_size": 65024}  # fmt: skip


@pytest.mark.parametrize(
    "config, expected",
    [
        (GPT2_JSON, (768, 12, 12, 12, 64, 3072, True, 1024)),  # n_inner None: 4 × hidden
        (OPT_JSON, (768, 12, 12, 12, 64, 3072, True, 2048)),  # OPT ties by default
        (QWEN_JSON, (3584, 28, 4, 28, 128, 18944, False, 32768)),
        (FALCON_JSON, (4544, 71, 1, 32, 64, 18176, True, 2048)),  # multi-query: one KV head
    ],
    ids=["gpt2", "opt", "qwen2", "falcon"],
)
def test_sizes_read_through_one_normalisation_of_each_familys_names(config, expected):
    s = model_sizes(config)
    got = (s.hidden, s.heads, s.kv_heads, s.layers, s.head_dim, s.intermediate, s.tied,
           s.max_positions)  # fmt: skip
    assert got == expected


def test_a_config_without_a_size_names_what_it_looked_for():
    with pytest.raises(ConfigSizeError, match="no attention head count .*n_head"):
        model_sizes({"model_type": "custom", "hidden_size": 8, "num_hidden_layers": 1,
                     "vocab_size": 10})  # fmt: skip


def _meta(family_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(family_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_blocks_are_the_models_own_no_split_modules(family, tiny_family):
    model = _meta(tiny_family(family))
    blocks = decoder_blocks(model)
    assert len(blocks) == model.config.num_hidden_layers == 2
    assert all(type(b).__name__ in model._no_split_modules for b in blocks)
    import peft

    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear"))
    assert decoder_blocks(wrapped) == blocks  # a peft wrapper is looked through


def test_lora_targets_are_checked_against_the_familys_linear_layers(tiny_family):
    gpt2 = _meta(tiny_family("gpt2"))
    assert block_linear_names(gpt2) == ["c_attn", "c_fc", "c_proj"]
    problem = lora_target_problem(gpt2, ["q_proj", "v_proj"])
    assert problem == (
        "['q_proj', 'v_proj'] name no linear layer of gpt2's blocks (its linear layers: "
        "['c_attn', 'c_fc', 'c_proj']; peft's default for gpt2: ['c_attn']; or [all-linear])"
    )
    assert lora_target_problem(gpt2, ["c_attn"]) is None
    assert lora_target_problem(gpt2, ["attn.c_proj"]) is None  # peft's dotted suffix
    assert lora_target_problem(_meta(tiny_family("opt")), ["q_proj", "fc1"]) is None


def test_what_is_no_decoder_only_causal_lm_is_named():
    from transformers import AutoConfig, Qwen2Config

    t5 = AutoConfig.for_model("t5")
    assert "an encoder-decoder model (t5)" in architecture_problem(t5)
    clip = AutoConfig.for_model("clip")
    assert "no causal LM for model_type 'clip'" in architecture_problem(clip)
    classifier = Qwen2Config(architectures=["Qwen2ForSequenceClassification"])
    assert "its weights are a Qwen2ForSequenceClassification, not a causal LM" in (
        architecture_problem(classifier)
    )
    assert architecture_problem(Qwen2Config(architectures=["Qwen2ForCausalLM"])) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_packing_probe_answers_what_packed_and_padded_forwards_show(family, tiny_family):
    """The probe's answer for each family equals what the family's own model does with two
    sequences packed in one row (OPT builds its mask without the restarting positions)."""
    from fleetrl.models.loading import load_causal_lm
    from fleetrl.models.packing_probe import packs_sequences

    model = load_causal_lm(tiny_family(family)).eval()
    first, second = torch.tensor([[7, 8, 9, 10]]), torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([first, second], 1),
            position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
            use_cache=False,
        ).logits[:, 4:]
        alone = model(input_ids=second, use_cache=False).logits
    keeps_apart = torch.allclose(packed, alone, atol=1e-5)
    assert keeps_apart == (family != "opt")
    assert packs_sequences(model.config) == keeps_apart
