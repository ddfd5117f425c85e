"""The fused decode step gives the Hugging Face model's numbers: per-row logits against a
full recomputation (rows of different lengths, so padding is exercised), weight loads
reaching the fused GEMMs, and a clean fallback for architectures it does not cover."""

from __future__ import annotations

import pytest
import torch

from rollout_fleet.engine.fused_decoder import FusedDecoder, unsupported_reason
from rollout_fleet.engine.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
STEPS = 6


def _qwen3_dir(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from fleetrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def _decode_logits(runner: ModelRunner) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill PROMPTS one by one (each joins the batch, right-aligned), then greedy-decode
    STEPS tokens for all rows; returns the token sequences and each step's logits."""
    torch.manual_seed(0)
    for prompt in PROMPTS:
        _, keys, values = runner.prefill(torch.tensor([prompt]))
        runner.kv.rebuild(list(range(runner.kv.rows)), [(keys, values)], reserve=4)
    sequences = [list(p) for p in PROMPTS]
    tokens = torch.tensor([20, 21, 22])
    for seq, token in zip(sequences, tokens.tolist(), strict=True):
        seq.append(token)
    step_logits = []
    for _ in range(STEPS):  # more steps than the reserve: the cache grows mid-way
        logits = runner.decode(tokens)
        step_logits.append(logits)
        tokens = logits.argmax(dim=-1)
        for seq, token in zip(sequences, tokens.tolist(), strict=True):
            seq.append(token)
    return sequences, step_logits


def _assert_matches_full_forward(runner: ModelRunner, atol: float) -> None:
    sequences, step_logits = _decode_logits(runner)
    for row, seq in enumerate(sequences):
        with torch.inference_mode():
            full = runner.model(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
        expected = full[-STEPS:]
        got = torch.stack([logits[row] for logits in step_logits]).float()
        assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "llama_gqa", "qwen3"])
def test_fused_decode_equals_a_full_forward_for_each_row(arch, tiny_model_dir, tmp_path):
    if arch == "qwen2":
        model_dir = tiny_model_dir
    elif arch == "llama_gqa":
        from fleetrl.models.tiny import make_tiny_model

        model_dir = make_tiny_model(tmp_path / "m", arch="llama", hidden=64, heads=4, kv_heads=2)
    else:
        model_dir = _qwen3_dir(tmp_path)
    runner = ModelRunner(model_dir)
    assert runner.fused is not None
    _assert_matches_full_forward(runner, atol=1e-4)


def test_fused_and_hugging_face_decode_steps_agree(tiny_model_dir):
    fused = ModelRunner(tiny_model_dir)
    plain = ModelRunner(tiny_model_dir, fused_decode=False)
    assert fused.fused is not None and plain.fused is None
    seq_fused, logits_fused = _decode_logits(fused)
    seq_plain, logits_plain = _decode_logits(plain)
    assert seq_fused == seq_plain
    for a, b in zip(logits_fused, logits_plain, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


# Measured: the largest |fused - full forward| over these prompts, for qwen2 and llama (GQA)
# tiny models of seeds 0-5, is 0.0039 = 2^-8, one bfloat16 ulp at |logit| in [0.5, 1)
# (summation order differs). 4x that leaves room for other seeds, not for a real bug.
BF16_LOGIT_ATOL = 4 * 2**-8


def test_bfloat16_fused_decode_stays_close_to_the_full_forward(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, dtype="bfloat16")
    assert runner.fused is not None
    _assert_matches_full_forward(runner, atol=BF16_LOGIT_ATOL)


def test_loaded_weights_reach_the_fused_projections(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir)
    names = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.mlp.up_proj.weight",
    ]
    generator = torch.Generator().manual_seed(1)
    weights = runner.named_weights()
    update = [(n, torch.randn(weights[n].shape, generator=generator) * 0.2) for n in names]
    runner.load_weights(update)
    fused = runner.fused
    assert fused is not None
    k_rows = fused.num_kv_heads * fused.head_dim
    q_rows = fused.num_heads * fused.head_dim
    assert torch.equal(fused.layers[0].qkv_weight[q_rows : q_rows + k_rows], update[0][1])
    _assert_matches_full_forward(runner, atol=1e-4)


def test_replacing_a_parameter_instead_of_copying_is_detected(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir)
    assert runner.fused is not None
    runner.fused.check_fused()
    q_proj = runner.model.model.layers[0].self_attn.q_proj
    q_proj.weight.data = q_proj.weight.detach().clone()
    with pytest.raises(RuntimeError, match="replaced instead of copied"):
        runner.fused.check_fused()


def test_float32_rms_norm_is_bit_identical_to_hugging_face(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir)
    norm = runner.model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.shape[0]))
    x = torch.randn(5, norm.weight.shape[0])
    ours = FusedDecoder._rms_norm(x, norm.weight, norm.variance_epsilon)
    assert torch.equal(ours, norm(x))


def test_unsupported_architectures_fall_back_to_the_hugging_face_forward(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fleetrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    runner = ModelRunner(tmp_path)
    assert "sliding" in (unsupported_reason(runner.model) or "")
    assert runner.fused is None
    with pytest.raises(ValueError, match="sliding"):
        FusedDecoder(runner.model)
