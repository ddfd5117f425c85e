"""Chat templates with tool calls for the project's tiny models (their tokenizer has none).

``TOOLS_TEMPLATE`` is ChatML in Qwen2.5's tool format, shortened for a character
tokenizer: the tools offered are listed as ``name(arg,...)`` in a system turn, a
tool call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` inside the
assistant turn, and tool results come back in a user turn as
``<tool_response>...</tool_response>``, consecutive results in one turn (as
Qwen2.5's template does). The agent gateway detects its format as ``hermes``.

``set_chat_template(model_dir, template)`` writes a template into a model folder's
tokenizer (the tiny builder writes plain ChatML).
"""

from __future__ import annotations

from pathlib import Path

TOOLS_TEMPLATE = (
    "{%- set first = messages[0] if messages else none -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if first and first.role == 'system' %}{{ first.content + '\\n' }}{% endif -%}"
    "{{ 'Tools:' }}{% for tool in tools %}{{ ' ' + tool.function.name + '('"
    " + (tool.function.parameters.properties | list | join(',')) + ')' }}{% endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif first and first.role == 'system' -%}"
    "{{ '<|im_start|>system\\n' + first.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls -%}"
    "{{ '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def set_chat_template(model_dir: str | Path, template: str) -> None:
    """Save ``template`` as the chat template of the tokenizer in ``model_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(model_dir)
