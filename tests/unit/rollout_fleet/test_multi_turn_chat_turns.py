"""An environment reply's tokens are the chat template's rendering after the generated turn."""

from __future__ import annotations

import pytest

from fleetrl.models.tiny import build_tokenizer
from rollout_fleet.multi_turn.chat_turns import ChatTemplateMismatch, ChatTurns
from rollout_fleet.sample_runner import SampleFailed

USER = {"role": "user", "content": "What is 6*7?"}
TOOL = {"role": "tool", "content": "42"}

# Drops the content of every assistant turn but the last, as templates that strip past
# reasoning do: adding a message re-renders the turn before it.
FORGETFUL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_reply_after_a_turn_ended_by_im_end_is_the_template_delta(tokenizer):
    chat = ChatTurns(tokenizer)
    turn = ids(tokenizer, "<calc>6*7</calc>") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    content = chat.assistant_content(turn)
    assert content == "<calc>6*7</calc>"
    messages = [USER, {"role": "assistant", "content": content}]
    reply = chat.observation_ids(messages, TOOL, turn, "g/0")
    assert reply == ids(tokenizer, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    # prompt + the policy's tokens + the reply = the template's rendering of the conversation
    prompt = ids(tokenizer, chat.render([USER], generation_prompt=True))
    whole = ids(tokenizer, chat.render([*messages, TOOL], generation_prompt=True))
    assert prompt + turn + reply == whole


def test_a_turn_ended_by_another_stop_token_gets_the_whole_closing(tokenizer):
    chat = ChatTurns(tokenizer)
    turn = ids(tokenizer, "<calc>6*7</calc>")  # stopped on '>' (a configured stop token)
    messages = [USER, {"role": "assistant", "content": chat.assistant_content(turn)}]
    reply = chat.observation_ids(messages, TOOL, turn, "g/0")
    assert reply == ids(
        tokenizer, "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rerenders_earlier_turns_is_refused_naming_the_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = FORGETFUL_TEMPLATE
    chat = ChatTurns(tokenizer)
    assert chat.name
    turn = ids(tokenizer, "<calc>6*7</calc>") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    messages = [USER, {"role": "assistant", "content": chat.assistant_content(turn)}]
    with pytest.raises(ChatTemplateMismatch) as raised:
        chat.observation_ids(messages, TOOL, turn, "g/5")
    assert isinstance(raised.value, SampleFailed)
    text = str(raised.value)
    assert text.startswith("sample g/5: the chat template of tokenizer ")
    assert repr(chat.name) in text and "not a prefix" in text


def test_a_turn_ended_by_a_special_token_outside_the_closing_gets_the_whole_closing(tokenizer):
    chat = ChatTurns(tokenizer)
    turn = ids(tokenizer, "12") + [tokenizer.convert_tokens_to_ids("<eos>")]
    messages = [USER, {"role": "assistant", "content": chat.assistant_content(turn)}]
    assert messages[-1]["content"] == "12"
    reply = chat.observation_ids(messages, TOOL, turn, "g/0")
    assert reply == ids(
        tokenizer, "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
