"""Model scores: the reward model's input ids in its own tokens, one batched client call per
group, normalisation and clipping, and every way a batch or a sample can fail.

The reward model's tokenizer here differs from the policy's (another vocabulary and
another chat template), so a test passes only if the prompt is re-rendered for it.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from fleetrl.models.reward_folder import RewardStats
from fleetrl.models.tiny import build_tokenizer
from rollout_fleet.rewards.model_input import RewardModelInputs
from rollout_fleet.rewards.model_scorer import ModelScorer, servers_from_urls
from tests.unit.rollout_fleet.reward_fakes import RewardServerError, ScriptedClient

MESSAGES = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}]
HUMAN_TEMPLATE = (
    "{% for m in messages %}{{ ('Human: ' if m['role'] != 'assistant' else 'Assistant: ')"
    " + m['content'] + '\n' }}{% endfor %}"
)


def rm_tokenizer(template: str | None = HUMAN_TEMPLATE):
    tok = build_tokenizer(alphabet="9876543210 +=?:HumanAsitd\n")  # not the policy's ids
    tok.chat_template = template
    return tok


def _text(inputs: RewardModelInputs, prompt, response: str) -> str:
    return inputs.tokenizer.decode(inputs.input_ids(prompt, response))


def test_the_prompt_is_re_rendered_with_the_reward_models_own_chat_template_and_eos():
    tok = rm_tokenizer()
    inputs = RewardModelInputs(tok, apply_chat_template="auto", max_length=100)
    # the template's trailing newline stripped, then the EOS id (no space before it)
    text = "Human: add\nHuman: 3+4=\nAssistant: 7<|im_end|>"
    assert _text(inputs, MESSAGES, "7") == text
    ids = inputs.input_ids(MESSAGES, "7")
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id
    policy = build_tokenizer()
    assert ids != policy.encode(text, add_special_tokens=False)  # other vocabulary


def test_a_chatml_template_that_ends_with_eos_gets_none_added():
    tok = build_tokenizer()  # ChatML: the assistant turn ends with <|im_end|> = EOS
    inputs = RewardModelInputs(tok, apply_chat_template="on", max_length=100)
    text = _text(inputs, MESSAGES, "7")
    assert text.endswith("<|im_start|>assistant\n7<|im_end|>")
    assert text.count("<|im_end|>") == 3


def test_without_a_template_the_prompt_text_and_response_are_joined():
    for tok, mode in ((rm_tokenizer(None), "auto"), (rm_tokenizer(), "off")):
        inputs = RewardModelInputs(tok, apply_chat_template=mode, max_length=100)
        assert _text(inputs, MESSAGES, "7") == "add\n3+4=7<|im_end|>"
    with pytest.raises(ValueError, match="apply_chat_template is 'on' but .* no chat template"):
        RewardModelInputs(rm_tokenizer(None), apply_chat_template="on", max_length=10)


def test_long_inputs_keep_their_last_tokens_so_the_scored_end_stays():
    tok = rm_tokenizer()
    inputs = RewardModelInputs(tok, apply_chat_template="on", max_length=6)
    full = RewardModelInputs(tok, apply_chat_template="on", max_length=100).input_ids(MESSAGES, "7777")  # fmt: skip
    ids = inputs.input_ids(MESSAGES, "7777")
    assert ids == full[-6:] and ids[-1] == tok.eos_token_id
    assert inputs.num_truncated == 1


def scorer(replies, *, stats=None, clip=0.0) -> tuple[ModelScorer, ScriptedClient]:
    client = ScriptedClient(replies)
    inputs = RewardModelInputs(rm_tokenizer(), apply_chat_template="auto", max_length=100)
    client.set_servers(servers_from_urls(["http://127.0.0.1:1/", "http://127.0.0.1:2"]))
    return ModelScorer(client, inputs, stats=stats, clip=clip), client


def test_a_group_is_scored_in_one_client_call_then_normalised_and_clipped():
    model, client = scorer([[3.0, -30.0, 1.0]], stats=RewardStats(mean=1.0, std=0.5), clip=10.0)
    scores = asyncio.run(model.score(MESSAGES, ["7", "8", "9"]))
    assert len(client.calls) == 1 and len(client.calls[0]) == 3
    assert client.calls[0][0] == model.inputs.input_ids(MESSAGES, "7")
    assert [s.raw for s in scores] == [3.0, -30.0, 1.0]
    assert [s.score for s in scores] == [4.0, -10.0, 0.0]  # (raw - 1) / 0.5, clipped at ±10
    assert not any(s.failed for s in scores)


def test_without_statistics_or_clip_the_raw_score_is_the_score():
    model, _ = scorer([[123.0]])
    (score,) = asyncio.run(model.score(MESSAGES, ["7"]))
    assert score.score == score.raw == 123.0


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (RewardServerError("batch of 3 not scored by reward-0, reward-1"), "not scored by"),
        (ConnectionResetError("reset by peer"), "reset by peer"),
        (TimeoutError("read timed out"), "read timed out"),
        ([1.0, 2.0], "2 scores for 3 inputs"),
    ],
)
def test_a_batch_the_client_cannot_score_fails_every_sample_of_the_group(reply, error):
    model, _ = scorer([reply])
    scores = asyncio.run(model.score(MESSAGES, ["7", "8", "9"]))
    assert all(s.failed and error in s.error for s in scores)
    stats = model.stats()
    assert stats["reward/model_batches_failed"] == 1.0
    assert stats["reward/model_samples_failed"] == 3.0


def test_a_non_finite_score_fails_only_its_sample():
    model, _ = scorer([[1.0, math.nan, -math.inf]])
    scores = asyncio.run(model.score(MESSAGES, ["7", "8", "9"]))
    assert [s.failed for s in scores] == [False, True, True]
    assert "not finite: nan" in scores[1].error
    assert model.stats()["reward/model_non_finite"] == 2.0


def test_set_servers_reaches_the_client_and_the_mapping_names_urls_in_order():
    model, client = scorer([])
    assert model.servers == {
        "reward-url-0": "http://127.0.0.1:1",
        "reward-url-1": "http://127.0.0.1:2",
    }
    model.set_servers({"reward-0": "http://127.0.0.1:9"})
    assert client.servers == model.servers == {"reward-0": "http://127.0.0.1:9"}
