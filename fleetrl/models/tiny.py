"""Build a tiny, real Hugging Face model folder: a random-init causal LM of one of
``FAMILIES`` (Qwen2, Llama, GPT-2, GPT-NeoX, OPT, Phi, Gemma: block layouts that
all differ) with a tokenizer in that family's style and a chat template.

Nothing is downloaded: the tokenizers are assembled from the ``tokenizers``
library, so the folder loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``
and, on GPU nodes, with SGLang. Used by tests, the CPU demo and the benchmarks.
Qwen2's tokenizer (the demo's) has one token per character of
``DEFAULT_ALPHABET`` plus special tokens; the other families' are trained BPEs
in their own style (``fleetrl.models.tiny_tokenizers``).

Qwen2's vocabulary is written in GPT-2's byte-level alphabet (" " is "Ġ", "\n" is
"Ċ") as a BPE model without merges: transformers 5 loads a ``qwen2`` folder with
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the vocabulary and
ignores the saved pre-tokenizer; a plain character vocabulary would then lose
every space and newline. Byte-level symbols tokenize the same either way.

Run: ``fleetrl model tiny --out DIR [--family gpt2 --layers 2 --hidden 64 --heads 4]``.
"""

from __future__ import annotations

import string
from pathlib import Path

from fleetrl.models.config import TINY_FAMILIES

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


FAMILIES = TINY_FAMILIES  # their block layouts all differ
_MHA_ONLY = ("gpt2", "gpt_neox", "opt", "phi")  # no grouped-query attention in their configs


def build_any_tokenizer(arch: str, alphabet: str = DEFAULT_ALPHABET):
    """The tiny tokenizer of ``arch``: Qwen2's character tokenizer, or the family's own
    (``fleetrl.models.tiny_tokenizers``)."""
    if arch == "qwen2":
        return build_tokenizer(alphabet)
    from fleetrl.models.tiny_tokenizers import build_family_tokenizer

    return build_family_tokenizer(arch)


def tiny_config(
    arch: str,
    tok,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int | None,
    intermediate: int | None,
    max_positions: int,
    vocab_size: int | None,
    tie_embeddings: bool | None,
):
    """The transformers config of a tiny ``arch`` model over tokenizer ``tok`` (each family's
    own names for the same sizes; ``tie_embeddings`` None keeps the family's default)."""
    from transformers import CONFIG_MAPPING

    if arch not in FAMILIES:
        raise ValueError(f"--family {arch!r} is not supported; accepted: {', '.join(FAMILIES)}")
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} must be divisible by --heads {heads}")
    if kv_heads not in (None, heads) and arch in _MHA_ONLY:
        raise ValueError(f"--kv-heads: {arch} has no grouped-query attention")
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tok)} tokens")
    ffn = intermediate or 4 * hidden
    sizes = {
        "gpt2": dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn,
                     n_positions=max_positions),
        "opt": dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    ffn_dim=ffn, word_embed_proj_dim=hidden, max_position_embeddings=max_positions),
    }.get(arch, dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=ffn, max_position_embeddings=max_positions,
    ))  # fmt: skip
    if arch in ("qwen2", "llama", "gemma"):
        sizes["num_key_value_heads"] = kv_heads or heads
    if arch == "gemma":
        sizes["head_dim"] = hidden // heads
    if tie_embeddings is not None:
        sizes["tie_word_embeddings"] = tie_embeddings
    return CONFIG_MAPPING[arch](
        vocab_size=vocab_size or len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
        **sizes,
    )


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
    tie_embeddings: bool | None = None,
) -> Path:
    """Write a random-init model folder (config, safetensors weights, tokenizer) of family
    ``arch`` (one of ``FAMILIES``): a causal LM, or with ``reward_model`` a one-label
    ``*ForSequenceClassification`` (a reward model).

    ``vocab_size`` (at least the tokenizer's) gives the embedding and LM head a real model's
    width (Qwen2.5's 151,936) while the tokenizer stays the tiny one; the ids above it are
    never produced by the tokenizer. ``tie_embeddings`` shares the LM head with the embedding
    (as Qwen2.5-0.5B does); None keeps the family's default (GPT-2, OPT and Gemma tie)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = Path(out)
    tok = build_any_tokenizer(arch, alphabet)
    config = tiny_config(
        arch, tok, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        intermediate=intermediate, max_positions=max_positions, vocab_size=vocab_size,
        tie_embeddings=tie_embeddings,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if reward_model:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = _stop_ids(arch, tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _stop_ids(arch: str, tok) -> int | list[int]:
    """What ends generation: the EOS, and a family's end-of-turn tokens (Gemma's)."""
    if arch == "qwen2":
        return tok.eos_token_id
    from fleetrl.models.tiny_tokenizers import stop_token_ids

    ids = stop_token_ids(arch, tok)
    return ids[0] if len(ids) == 1 else ids
