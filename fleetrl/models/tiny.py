"""Build a tiny, real Hugging Face model folder: random-init Qwen2 or Llama plus a
character-level tokenizer with a chat template.

Nothing is downloaded: the tokenizer is assembled from the ``tokenizers``
library (one token per character of ``DEFAULT_ALPHABET`` plus special tokens),
so the folder loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and, on
GPU nodes, with SGLang. Used by tests, the CPU demo and the benchmarks.

The vocabulary is written in GPT-2's byte-level alphabet (" " is "Ġ", "\n" is
"Ċ") as a BPE model without merges: transformers 5 loads a ``qwen2`` folder with
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the vocabulary and
ignores the saved pre-tokenizer; a plain character vocabulary would then lose
every space and newline. Byte-level symbols tokenize the same either way.

Run: ``fleetrl model tiny --out DIR [--layers 2 --hidden 64 --heads 4 --arch qwen2]``.
"""

from __future__ import annotations

import string
from pathlib import Path

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=?.,:;!()[]{}<>#$%&'\"_\n\\|^~@`"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]

# ChatML, the template Qwen2 uses; renders a list of {role, content} messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_symbols() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers emit)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level ``PreTrainedTokenizerFast`` with ChatML specials (byte-level symbols)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if any(ord(ch) > 127 for ch in alphabet):
        raise ValueError("the tiny tokenizer's alphabet must be ASCII (one byte per character)")
    to_symbol = _byte_level_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(to_symbol[ord(ch)], len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<eos>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(
    out: str | Path,
    *,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    reward_model: bool = False,
    vocab_size: int | None = None,
    tie_embeddings: bool = False,
) -> Path:
    """Write a random-init model folder (config, safetensors weights, tokenizer): a causal LM,
    or with ``reward_model`` a one-label ``*ForSequenceClassification`` (a reward model).

    ``vocab_size`` (at least the tokenizer's) gives the embedding and LM head a real model's
    width (Qwen2.5's 151,936) while the tokenizer stays the tiny one; the ids above it are
    never produced by the tokenizer. ``tie_embeddings`` shares the LM head with the embedding,
    as Qwen2.5-0.5B does."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        LlamaConfig,
        Qwen2Config,
    )

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"--arch {arch!r} is not supported; accepted: qwen2, llama")
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} must be divisible by --heads {heads}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(alphabet)
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tok)} tokens")
    common = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=tie_embeddings,
        torch_dtype="float32",
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    if reward_model:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
