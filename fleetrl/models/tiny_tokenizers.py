"""Tiny tokenizers in each family's own style, built with the ``tokenizers`` library.

Each family's tokenizer differs in ways that reach training: how text becomes
pieces, which special tokens exist and at which ids, whether encoding adds a BOS,
what ends a turn. The tiny models keep those differences at a small vocabulary,
so a test on a tiny GPT-2 meets what a real GPT-2 folder brings:

- byte-level BPE (GPT-2's ``Ġ`` alphabet, merges trained here) for GPT-2, GPT-NeoX,
  OPT and Phi: GPT-2 and Phi with one ``<|endoftext|>`` (BOS, EOS and UNK, no pad)
  after the merges; GPT-NeoX with ``<|endoftext|>`` and ``<|padding|>`` first;
  OPT with ``<s> <pad> </s> <unk>`` first and ``</s>`` prepended to every encoding;
- SentencePiece-style BPE (``▁`` for a space, byte fallback ``<0x..>`` for any
  byte outside the pieces) for Llama (``<unk> <s> </s>``, BOS added, no pad) and
  Gemma (``<pad> <eos> <bos> <unk>``, BOS added, ``<start_of_turn>`` /
  ``<end_of_turn>`` turns).

Merges are trained on ``CORPUS`` (arithmetic questions and answers, the demo's
kind of text): the same pieces on every build. Every tokenizer has a chat template
(the family's turn format; a plain ``role: content`` one for the families that
ship none), so the default ``data.apply_chat_template`` works with each.

Qwen2's tiny tokenizer (one token per character, ChatML) is ``fleetrl.models.tiny``'s.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

BYTE_LEVEL_VOCAB = 384  # 256 bytes + merges
SENTENCEPIECE_VOCAB = 448  # specials + 256 byte-fallback pieces + characters + merges

# a plain template for families whose tokenizers ship none (GPT-2, GPT-NeoX, OPT, Phi)
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
PLAIN_BOS_TEMPLATE = "{{ bos_token }}" + PLAIN_TEMPLATE  # OPT: its text starts with its BOS
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Deterministic training text: questions, sums and answers in the demo's style."""
    lines = []
    for a in range(0, 100, 3):
        b = a % 10
        lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        lines.append(f"Tom has {a} apples and eats {b}.\n#### {a - b}")
        lines.append(f"user: add {a} and {b}\nassistant: {a + b}")
    return lines


CORPUS = _corpus()


@dataclass(frozen=True)
class TokenizerSpec:
    """One family's tokenizer: its pieces, its special tokens and what encoding adds."""

    style: str  # "byte_level" | "sentencepiece"
    leading_specials: tuple[str, ...]  # at ids 0, 1, ... before every piece
    trailing_specials: tuple[str, ...] = ()  # after the merges (GPT-2's <|endoftext|>)
    roles: dict[str, str] = field(default_factory=dict)  # bos/eos/unk/pad -> token
    add_bos: bool = False  # encoding prepends bos_token
    turn_tokens: tuple[str, ...] = ()  # extra special tokens of the chat template
    template: str = PLAIN_TEMPLATE
    stop_tokens: tuple[str, ...] = ()  # generation also ends at these (besides eos)


_ENDOFTEXT = "<|endoftext|>"
SPECS: dict[str, TokenizerSpec] = {
    "gpt2": TokenizerSpec(
        "byte_level", (), (_ENDOFTEXT,),
        {"bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT},
    ),
    "phi": TokenizerSpec(
        "byte_level", (), (_ENDOFTEXT,),
        {"bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT},
    ),
    "gpt_neox": TokenizerSpec(
        "byte_level", (_ENDOFTEXT, "<|padding|>"), (),
        {"bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "unk_token": _ENDOFTEXT,
         "pad_token": "<|padding|>"},
    ),
    "opt": TokenizerSpec(
        "byte_level", ("<s>", "<pad>", "</s>", "<unk>"), (),
        {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
        add_bos=True, template=PLAIN_BOS_TEMPLATE,
    ),
    "llama": TokenizerSpec(
        "sentencepiece", ("<unk>", "<s>", "</s>"), (),
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        add_bos=True, template=LLAMA_TEMPLATE,
    ),
    "gemma": TokenizerSpec(
        "sentencepiece", ("<pad>", "<eos>", "<bos>", "<unk>"), (),
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
        add_bos=True, turn_tokens=("<start_of_turn>", "<end_of_turn>"), template=GEMMA_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
    ),
}  # fmt: skip


def _byte_level_core(spec: TokenizerSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_LEVEL_VOCAB,
        special_tokens=list(spec.leading_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    return core


def _sentencepiece_core(spec: TokenizerSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(
        models.BPE(unk_token=spec.roles["unk_token"], byte_fallback=True, fuse_unk=True)
    )
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    characters = [c for c in string.printable if not c.isspace()] + ["▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=SENTENCEPIECE_VOCAB,
        special_tokens=[*spec.leading_specials, *byte_pieces],
        initial_alphabet=characters,
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    return core


def build_family_tokenizer(family: str) -> Any:
    """A ``PreTrainedTokenizerFast`` in ``family``'s style (see the module docstring)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if family not in SPECS:
        raise ValueError(f"no tiny tokenizer for {family!r}; accepted: {sorted(SPECS)}")
    spec = SPECS[family]
    core = _byte_level_core(spec) if spec.style == "byte_level" else _sentencepiece_core(spec)
    core.add_special_tokens([*spec.trailing_specials, *spec.turn_tokens])
    if spec.add_bos:
        bos = spec.roles["bos_token"]
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, core.token_to_id(bos))]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=list(spec.turn_tokens) or None,
        **spec.roles,
    )
    tok.chat_template = spec.template
    return tok


def stop_token_ids(family: str, tokenizer: Any) -> list[int]:
    """The ids that end generation: EOS, then the family's end-of-turn tokens."""
    spec = SPECS.get(family)
    extra = [tokenizer.convert_tokens_to_ids(t) for t in (spec.stop_tokens if spec else ())]
    return [tokenizer.eos_token_id, *extra]
