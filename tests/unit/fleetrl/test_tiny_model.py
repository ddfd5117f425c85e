"""Tiny model folders are real Hugging Face models: they load with the Auto classes, render the
chat template, tokenize text with spaces and newlines losslessly, and run a forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.models.loading import ModelPathError, load_causal_lm, load_tokenizer
from fleetrl.models.tiny import build_tokenizer

TEXT = "Tom has 12 apples.\n  He eats 3: 12 - 3 = 9?\n\n#### 9 (done)"


@pytest.fixture(params=["qwen2", "llama"])
def model_dir(request, tiny_model_dir, tiny_llama_dir):
    return tiny_model_dir if request.param == "qwen2" else tiny_llama_dir


def test_auto_tokenizer_round_trips_text_with_spaces_and_newlines(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)  # one token per character
    assert tokenizer.decode(ids) == TEXT
    # The saved folder tokenizes exactly like the in-memory tokenizer that built it.
    assert ids == build_tokenizer().encode(TEXT, add_special_tokens=False)


def test_chat_template_renders_chatml_with_generation_prompt(model_dir):
    tokenizer = load_tokenizer(model_dir)
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


def test_auto_model_loads_and_a_forward_pass_gives_vocab_logits(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = load_tokenizer(model_dir)
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer.encode("3+5=", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, len(tokenizer))
    assert torch.isfinite(logits).all()
    assert load_causal_lm(model_dir, dtype="bfloat16").dtype == torch.bfloat16


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
