"""Build what ``make demo-agent`` trains: the calculator task's data and a tiny policy that uses
the tool badly.

- ``OUT/data/{train,test}.parquet``: ``synth/calc_tool`` rows ("What is 47*86+3?" ->
  "4045"); the test rows' instances are never trained on.
- ``OUT/model``: a tiny Qwen2-shaped model with the project's character tokenizer and a
  chat template with tool calls (``fleetrl.models.chat_templates.TOOLS_TEMPLATE``),
  warm-started by supervision on whole agent conversations as the gateway renders them
  (``rollout_fleet.gateway.rendering``: prompt, tool call, the template's tool turn,
  answer; loss on the two assistant turns only). In ``--label-noise`` of them the call's
  expression is wrong (the last digit one more) and the answer restates the tool's
  result, so the model has the format and the copying, and mostly the wrong call: RL must
  make it call the tool with the question's own expression.

Run: ``python examples/agents/build_calculator_demo.py --out runs/demo/agent`` (it does
nothing when ``OUT/model`` exists).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calculator_agent import TOOLS, calc  # noqa: E402

from fleetrl.data.synth import write_synth_dataset  # noqa: E402
from fleetrl.log import get_logger, setup_logging  # noqa: E402
from fleetrl.models.chat_templates import TOOLS_TEMPLATE, set_chat_template  # noqa: E402
from fleetrl.models.config import WarmStartConfig  # noqa: E402
from fleetrl.models.tiny import make_tiny_model  # noqa: E402

log = get_logger("build_calculator_demo")


def conversation_row(renderer, question: str, expression: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of one agent conversation, rendered as the gateway renders its calls."""
    eos = renderer.tokenizer.eos_token_id
    messages = [{"role": "user", "content": question}]
    prompt = renderer.prompt_ids(messages, TOOLS)
    call = (
        '<tool_call>{"name": "calc", "arguments": '
        + json.dumps({"expr": expression})
        + "}</tool_call>"
    )
    turn = renderer.encode(call) + [eos]
    result = calc(expression)
    history = [*messages, {"role": "assistant", "content": call}]
    tool_turn = renderer.continuation_ids(
        history, turn, [{"role": "tool", "content": result}], TOOLS
    )
    answer = renderer.encode(result) + [eos]
    ids = prompt + turn + tool_turn + answer
    labels = [-100] * len(prompt) + turn + [-100] * len(tool_turn) + answer
    return ids, labels


def wrong(expression: str) -> str:
    """The deliberate mistake: the last digit one more (mod 10)."""
    return expression[:-1] + str((int(expression[-1]) + 1) % 10)


def build(out: Path, args: argparse.Namespace) -> None:
    from learner.sft import supervised_warmstart_rows
    from rollout_fleet.gateway.rendering import ChatRenderer

    train, _ = write_synth_dataset(
        "calc_tool", out / "data", args.train_size, args.test_size, args.seed
    )
    import pyarrow.parquet as pq

    rows = pq.read_table(train, columns=["prompt"]).column("prompt").to_pylist()
    # the warm start draws from the first --warmstart-questions (each rendered once, cached)
    questions = [row[0]["content"] for row in rows[: args.warmstart_questions]]
    partial = out / "model.partial"
    shutil.rmtree(partial, ignore_errors=True)
    make_tiny_model(partial, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    max_positions=args.max_positions, seed=args.seed)  # fmt: skip
    set_chat_template(partial, TOOLS_TEMPLATE)
    from fleetrl.models.loading import load_tokenizer

    renderer = ChatRenderer(load_tokenizer(partial))

    @functools.cache
    def row(question: str, noisy: bool) -> tuple[list[int], list[int]]:
        expression = question.removeprefix("What is ").removesuffix("?")
        return conversation_row(renderer, question, wrong(expression) if noisy else expression)

    def draw(rng: random.Random) -> tuple[list[int], list[int]]:
        return row(rng.choice(questions), rng.random() < args.label_noise)

    cfg = WarmStartConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                          label_noise=args.label_noise, seed=args.seed)  # fmt: skip
    loss = supervised_warmstart_rows(partial, draw, cfg)
    partial.replace(out / "model")
    log.info("built %s/model: %d warm-start steps, final loss %.3f", out, args.steps, loss)


def main() -> int:
    parser = argparse.ArgumentParser(
        description="data and warm-started tiny model of make demo-agent"
    )
    parser.add_argument("--out", default="runs/demo/agent")
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-positions", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--label-noise", type=float, default=0.8)
    parser.add_argument("--warmstart-questions", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_logging("demo-agent", "INFO")
    out = Path(args.out)
    if (out / "model" / "config.json").is_file():
        log.info("%s/model exists: nothing to build", out)
        return 0
    build(out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
