"""Tiny tokenizers of the kinds users bring, built offline with ``tokenizers``.

- ``llama_style``: SentencePiece-like (``▁`` for a space, a Metaspace pre-tokenizer), BOS
  ``<s>`` added to every encoded text by its post-processor, EOS ``</s>``, no chat template
  (a base Llama);
- ``llama_chat``: the same with a Llama-2-style template that writes the BOS itself;
- ``gpt2_chatml``: GPT-2 byte-level (``Ġ`` for a space), a ChatML template whose turns end
  with ``<|im_end|>`` while EOS is ``<|endoftext|>`` (a Qwen base model);
- ``demo``: the project's tiny tokenizer, ChatML with EOS = ``<|im_end|>``.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from fleetrl.models.tiny import CHAT_TEMPLATE, build_tokenizer

ALPHABET = string.digits + string.ascii_letters + " +-*=?.,:![]/<>\n"
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}"
    "{% else %}{{ '<<SYS>>' + m['content'] + '<</SYS>>' }}{% endif %}{% endfor %}"
)


def llama_style(template: str | None = None) -> PreTrainedTokenizerFast:
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys("▁" + ALPHABET.replace(" ", "")):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>", clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tok.chat_template = template
    return tok


def gpt2_chatml() -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for symbol in sorted(alphabet):
        vocab.setdefault(symbol, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def kinds() -> dict[str, PreTrainedTokenizerFast]:
    return {
        "llama_style": llama_style(),
        "llama_chat": llama_style(LLAMA2_TEMPLATE),
        "gpt2_chatml": gpt2_chatml(),
        "demo": build_tokenizer(),
    }
