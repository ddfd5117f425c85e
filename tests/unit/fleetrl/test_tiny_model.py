"""Tiny model folders are real Hugging Face models: they load with the Auto classes, render the
chat template, tokenize text with spaces and newlines losslessly, and run a forward pass; each
family's folder has its own layout and a tokenizer with that family's conventions."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from fleetrl.models.loading import ModelPathError, load_causal_lm, load_tokenizer
from fleetrl.models.tiny import FAMILIES, build_tokenizer

TEXT = "Tom has 12 apples.\n  He eats 3: 12 - 3 = 9?\n\n#### 9 (done)"


def test_qwen2_tokenizer_has_one_token_per_character_and_round_trips(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)  # one token per character
    assert tokenizer.decode(ids) == TEXT
    # The saved folder tokenizes exactly like the in-memory tokenizer that built it.
    assert ids == build_tokenizer().encode(TEXT, add_special_tokens=False)


def test_chat_template_renders_chatml_with_generation_prompt(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+5="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in ids
    assert (
        tokenizer.decode(ids, skip_special_tokens=True)
        == "system\nbe brief\nuser\n3+5=\nassistant\n"
    )


# family -> (model class, what its blocks are, BOS added by encoding, pad token, tied head)
LAYOUTS = {
    "qwen2": ("Qwen2ForCausalLM", "model.layers", None, "<pad>", False),
    "llama": ("LlamaForCausalLM", "model.layers", "<s>", None, False),
    "gpt2": ("GPT2LMHeadModel", "transformer.h", None, None, True),
    "gpt_neox": ("GPTNeoXForCausalLM", "gpt_neox.layers", None, "<|padding|>", False),
    "opt": ("OPTForCausalLM", "model.decoder.layers", "</s>", "<pad>", True),
    "phi": ("PhiForCausalLM", "model.layers", None, None, False),
    "gemma": ("GemmaForCausalLM", "model.layers", "<bos>", "<pad>", True),
}


def test_every_family_is_described():
    assert set(LAYOUTS) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_with_its_layout_and_its_tokenizers_conventions(family, tiny_family):
    folder = tiny_family(family)
    model_class, blocks, bos, pad, tied = LAYOUTS[family]
    model = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    assert type(model).__name__ == model_class and len(model.get_submodule(blocks)) == 2
    assert model.config.vocab_size == len(tokenizer)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    ids = tokenizer.encode(TEXT)
    assert (tokenizer.convert_ids_to_tokens(ids[0]) == bos) if bos else ids[0] != tokenizer.bos_token_id  # fmt: skip
    assert tokenizer.pad_token == pad
    plain = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(plain) == TEXT
    assert len(plain) < len(TEXT) or family == "qwen2"  # trained merges; Qwen2's is per character
    messages = [{"role": "user", "content": "3+5="}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "3+5=" in prompt
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(logits).all()


def test_family_tokenizers_are_the_same_on_every_build(tmp_path):
    from fleetrl.models.tiny_tokenizers import build_family_tokenizer

    for family in ("gpt2", "llama"):
        a, b = build_family_tokenizer(family), build_family_tokenizer(family)
        assert a.get_vocab() == b.get_vocab() and a.encode(TEXT) == b.encode(TEXT)


def test_gemma_generation_stops_at_the_end_of_a_turn(tiny_family):
    model = load_causal_lm(tiny_family("gemma"))
    tokenizer = load_tokenizer(tiny_family("gemma"))
    stops = model.generation_config.eos_token_id
    assert stops == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]


def test_auto_model_loads_in_bfloat16(tiny_model_dir):
    assert load_causal_lm(tiny_model_dir, dtype="bfloat16").dtype == torch.bfloat16


def test_missing_or_incomplete_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist or is not a directory"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(ModelPathError, match="has no config.json"):
        load_causal_lm(tmp_path)


def test_a_wider_vocabulary_and_a_tied_head_give_a_real_models_shape(tmp_path):
    from fleetrl.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "wide", hidden=32, heads=2, vocab_size=1000,
                             tie_embeddings=True)  # fmt: skip
    model = load_causal_lm(folder)
    assert model.config.vocab_size == 1000 and model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.shape == (1000, 32)
    assert model.get_output_embeddings().weight.data_ptr() == (
        model.get_input_embeddings().weight.data_ptr()
    )
    tokenizer = load_tokenizer(folder)
    assert max(tokenizer.encode(TEXT, add_special_tokens=False)) < len(tokenizer) < 1000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[7, 999]])).logits
    assert logits.shape == (1, 2, 1000)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    from fleetrl.models.tiny import make_tiny_model

    with pytest.raises(ValueError, match="vocab_size 10 is below the tokenizer's"):
        make_tiny_model(tmp_path / "narrow", hidden=32, heads=2, vocab_size=10)
    with pytest.raises(ValueError, match="--kv-heads: gpt2 has no grouped-query attention"):
        make_tiny_model(tmp_path / "gqa", arch="gpt2", hidden=32, heads=4, kv_heads=2)
