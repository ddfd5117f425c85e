"""A calculator agent: the policy may call a ``calc`` tool, then answers with the number.

The agent of ``make demo-agent`` (configs/demo_agent_cpu.yaml), written as a user
writes one, against OpenAI's chat API with the ``openai`` client and nothing of
fleetrl: fleetrl calls ``run`` once per episode with the episode's ``base_url`` and
``api_key``, and the dataset row. The episode: ask the question with the tool
offered; run every tool call the policy makes and send the results back; the first
reply without a tool call is the answer. The reward is 1.0 when the answer equals
the row's ground truth, else 0.0, so the policy succeeds only by calling the tool
with the right expression and then restating its result: a two-layer model cannot
multiply two-digit numbers itself.

It also runs alone against any OpenAI-compatible server::

    python examples/agents/calculator_agent.py --base-url http://127.0.0.1:8000/v1 \\
        --api-key KEY --question "What is 47*86+3?" --answer 4045
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression of integers with + - *.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]
MAX_TURNS = 3
MAX_TOKENS = 96
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_clients: dict[tuple[str, int], openai.AsyncOpenAI] = {}


def calc(expression: str) -> str:
    """The tool: integers with + - * only (no eval); "error" for anything else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value < 10**6:
            return node.value
        raise ValueError("unsupported")

    try:
        return str(value(ast.parse(expression[:40], mode="eval").body))
    except (SyntaxError, ValueError):
        return "error"


def _client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    # one client per server and event loop: building one costs ~0.1 s of CPU, deriving
    # another key from it 15 us
    where = (base_url, id(asyncio.get_running_loop()))
    if where not in _clients:
        _clients[where] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return _clients[where].with_options(api_key=api_key)


async def solve(client: openai.AsyncOpenAI, messages: list[dict]) -> str:
    """Talk with the policy until it answers without a tool call; its answer."""
    for _ in range(MAX_TURNS):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
            )
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":  # the episode's budget is spent
                return ""
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return (message.content or "").strip()
        for call in message.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expr", ""))
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(expression)})
    return ""


async def run(base_url: str, api_key: str, sample: dict) -> float:
    """One episode (fleetrl's agent contract): 1.0 for the right answer, else 0.0."""
    answer = await solve(_client(base_url, api_key), [dict(m) for m in sample["prompt"]])
    return float(answer == str(sample["reward_model"]["ground_truth"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--question", required=True)
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    row = {"prompt": [{"role": "user", "content": args.question}],
           "reward_model": {"ground_truth": args.answer}}  # fmt: skip
    print(asyncio.run(run(args.base_url, args.api_key, row)))


if __name__ == "__main__":
    main()
