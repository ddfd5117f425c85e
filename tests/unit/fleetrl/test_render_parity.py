"""One rendering of prompts and reward-model inputs, over the tokenizers users bring.

Training (``PreferencePairs``, what ``rm train`` and ``rm eval`` read) and RL scoring
(``RewardModelInputs`` inside the ``ModelScorer``) must hand a reward model the very same
ids: tokenizers with and without a chat template, an EOS equal to the template's end
token and one that differs, plain-string and chat prompts, responses with and without a
trailing EOS and whitespace. Prompts without a template are encoded as the tokenizer
encodes text (a Llama's BOS included).
"""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.data.pairs import PreferencePairs
from fleetrl.data.preference import write_preference_rows
from rollout_fleet.rewards.model_input import RewardModelInputs
from rollout_fleet.rewards.model_scorer import ModelScorer
from tests.unit.fleetrl.tokenizer_kinds import kinds

KINDS = kinds()
PROMPTS = {
    "string": "Q: 2+3=?\nA:",
    "chat": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3=?"}],
}
RESPONSES = ["5", " 5", "5 ", "5\n", "5{eos}", "5 {eos}\n"]


class CapturingClient:
    """A reward-model client that records the ids it is asked to score."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.servers: dict[str, str] = {}

    async def score(self, input_ids: list[list[int]]) -> list[float]:
        self.seen.extend(input_ids)
        return [0.0] * len(input_ids)

    def stats(self) -> dict[str, float]:
        return {}


def _scored(tok, prompt, responses: list[str]) -> list[list[int]]:
    client = CapturingClient()
    scorer = ModelScorer(client, RewardModelInputs(tok, apply_chat_template="auto", max_length=4096))  # fmt: skip
    asyncio.run(scorer.score(prompt, responses))
    return client.seen


def _trained(tok, prompt, responses: list[str], tmp_path) -> list[list[int]]:
    rows = [{"prompt": prompt, "chosen": r, "rejected": "never"} for r in responses]
    path = write_preference_rows(rows, tmp_path / "pairs.parquet")
    pairs = PreferencePairs([path], tok, max_length=4096, apply_chat_template=True)
    assert len(pairs) == len(responses)
    return [pairs.chosen(i).tolist() for i in range(len(pairs))]


@pytest.mark.parametrize("prompt_kind", sorted(PROMPTS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_training_and_rl_scoring_build_the_same_ids(kind, prompt_kind, tmp_path):
    tok, prompt = KINDS[kind], PROMPTS[prompt_kind]
    responses = [r.format(eos=tok.eos_token) for r in RESPONSES]
    trained = _trained(tok, prompt, responses, tmp_path)
    scored = _scored(tok, prompt, responses)
    for response, train_ids, score_ids in zip(responses, trained, scored, strict=True):
        assert train_ids == score_ids, (kind, prompt_kind, response)
        # one EOS, last, right after the answer (no space token, no second EOS before it)
        assert score_ids[-1] == tok.eos_token_id and score_ids[-2] != tok.eos_token_id
        tail = tok.convert_ids_to_tokens(score_ids[-3:-1])
        # the answer, the template's own end of turn, or (Llama-2's template) its space
        assert tail[-1] in ("5", "<|im_end|>") or tail == ["5", "▁"], (kind, tail)
    # trailing whitespace and end markers do not change what is scored
    assert len({tuple(ids) for ids in scored[2:]}) == 1, kind


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_plain_string_prompt_is_never_wrapped_in_a_template(kind):
    tok = KINDS[kind]
    (ids,) = _scored(tok, PROMPTS["string"], ["5"])
    text = tok.decode(ids, skip_special_tokens=True)
    assert text.replace(" ", "").startswith("Q:2+3=?\nA:5"), (kind, text)
    if tok.bos_token is not None and not tok.chat_template:
        assert ids[0] == tok.bos_token_id  # encoded as the tokenizer encodes text


def test_eos_different_from_the_templates_end_token_is_appended_after_it():
    tok = KINDS["gpt2_chatml"]
    (ids,) = _scored(tok, PROMPTS["chat"], ["5"])
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["5", "<|im_end|>", "<|endoftext|>"]
    demo = KINDS["demo"]  # EOS is the template's end token: nothing added
    (ids,) = _scored(demo, PROMPTS["chat"], ["5"])
    assert demo.convert_ids_to_tokens(ids[-2:]) == ["5", "<|im_end|>"]
