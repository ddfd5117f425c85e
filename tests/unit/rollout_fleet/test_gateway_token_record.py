"""Token-in/token-out: a multi-turn tool episode trains on exactly the engine's ids plus the chat
template's rendering of the messages between them, also with a template that renders earlier
turns differently once later ones follow (reasoning stripped from non-final assistant turns,
as Qwen3 and DeepSeek-R1 templates do). The episode goes through the real gateway and the real
``openai`` client; the engine is scripted so its ids are known."""

from __future__ import annotations

import openai
import pytest

from fleetrl.models.chat_templates import TOOLS_TEMPLATE
from fleetrl.models.tiny import build_tokenizer
from tests.unit.rollout_fleet.gateway_harness import TOOLS, GatewayHarness, ScriptedEngine

# ChatML whose non-final assistant turns lose their <think>...</think> part
STRIPS_REASONING = (
    "{%- for message in messages -%}"
    "{%- set content = message.content -%}"
    "{%- if message.role == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- if message.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
TURN1 = '<think>use the tool</think><tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
TURN2 = "<think>it said 42</think>#### 42"
TURN3 = "<think>again</think>#### 42!"


def runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(mask value, ids) of each maximal run of equal mask values."""
    out: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return out


def reply(text: str) -> str:
    return {0: TURN1, 1: TURN2}.get(text.count("<tool_response>"), TURN3)


@pytest.mark.parametrize(
    "template", [TOOLS_TEMPLATE, STRIPS_REASONING], ids=["append_only", "strips_reasoning"]
)
def test_trained_ids_are_engine_ids_plus_template_between(template):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    engine = ScriptedEngine("e0", tokenizer, reply, version=3)
    harness = GatewayHarness(tokenizer, [engine])
    try:
        episode, key = harness.open_episode()
        chat = openai.OpenAI(base_url=harness.base_url, api_key=key, max_retries=0).chat
        messages = [{"role": "user", "content": "What is 6*7?"}]
        first = chat.completions.create(model="m", messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]  # fmt: skip
        second = chat.completions.create(model="m", messages=messages, tools=TOOLS)
        messages += [second.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Sure?"}]  # fmt: skip
        chat.completions.create(model="m", messages=messages, tools=TOOLS)
    finally:
        harness.close()
    (leaf,) = episode.leaves()
    progress = leaf.progress
    out1, out2, out3 = engine.outputs
    ids = progress.output_ids
    segments = runs(ids, progress.loss_mask)
    # 1. the trained (mask 1) segments are exactly the engine's outputs, in order, with
    # template (mask 0) segments between them
    assert [(m, seg) for m, seg in segments if m] == [(1, out1), (1, out2), (1, out3)]
    gap1, gap2 = [seg for m, seg in segments if not m]
    assert ids == out1 + gap1 + out2 + gap2 + out3
    # 2. between them, the template's rendering of the messages that came in, separators
    # included (the "\n" after the stop token <|im_end|>, which the engine did not write)
    tool_turn = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(gap1) == tool_turn
    assert tokenizer.decode(gap2) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    # 3. the prompt is the dataset rendering (render_prompt) of the first call's messages
    head = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(progress.prompt_ids).endswith(head)
    # 4. each call sent the engine the trajectory's ids up to that point (token in)
    sent = [r["input_ids"] for r in engine.requests]
    assert sent[1] == progress.prompt_ids + out1 + gap1
    assert sent[2] == progress.prompt_ids + out1 + gap1 + out2 + gap2
    # 5. generated tokens carry the engine's version; template tokens the one before them
    assert set(progress.token_versions) == {3}
    assert [lp for lp, m in zip(progress.logprobs, progress.loss_mask, strict=True) if not m] == [
        0.0
    ] * (len(gap1) + len(gap2))
    # the whole-conversation rendering of the stripping template drops the first turn's
    # reasoning, which the engine did see and generate: re-rendering would train on other ids
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": TURN1},
         {"role": "tool", "content": "42"}, {"role": "assistant", "content": TURN2}],
        tools=TOOLS, tokenize=False)  # fmt: skip
    assert "<think>use the tool" in tokenizer.decode(progress.prompt_ids + ids)
    assert ("<think>use the tool" in full) == (template is TOOLS_TEMPLATE)
