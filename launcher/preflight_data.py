"""Preflight of the prompt files and the tokenizer: what the rollout role would refuse late.

Every file of ``data.train_files`` and ``data.val_files`` is read through the schema
validator the rollout's reader uses (``fleetrl.data.schema.file_problems``): a missing
file or column, a prompt of the wrong type, a bad ``reward_model`` — every problem of
every file at once, one line each. The first ``RENDERED_ROWS`` rows of each file are then
rendered with the policy's tokenizer through the rollout's own renderer
(``fleetrl.data.reader.render_prompt``), as ``data.apply_chat_template`` says: a tokenizer
without a chat template while the template is on, a template that raises on the data,
a prompt over ``data.max_prompt_length`` with ``data.truncation=error``, and plain-string
prompts where multi-turn needs chat messages are refused here, before Ray starts,
instead of 20 seconds into the run inside a Ray traceback.

Files that do not exist yet because a synthetic task generates them (``data.synth_task``)
and a model folder built at start (``model.create_tiny``) are left to ``launcher.prepare``.
The rows ``data_rows`` read are kept for the reward trial (``launcher.preflight_reward_trial``).

Left out: rendering every row (a dataset of millions would take minutes; the reader
renders all of them when the run starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import RunConfig
from launcher.preflight_findings import Finding, _first_line, shown

RENDERED_ROWS = 8  # per file: rendered with the tokenizer before the run starts
DATA_FIX = (
    "fix the file: docs/data.md has the schema ('fleetrl data gsm8k' and 'fleetrl data synth' "
    "write valid files)"
)


@dataclass
class DataRows:
    """The rows preflight read: the first ``RENDERED_ROWS`` valid ones of each file."""

    findings: list[Finding] = field(default_factory=list)
    # (config key, file, row index, row) of the first valid rows of every file
    samples: list[tuple[str, str, int, dict[str, Any]]] = field(default_factory=list)


def data_rows(cfg: RunConfig) -> DataRows:
    """Read every prompt file through the rollout's validator; its problems and first rows."""
    from fleetrl.data.schema import file_problems

    out = DataRows()
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):  # fmt: skip
        for file in files:
            if not Path(file).is_file():
                if not cfg.data.synth_task:  # else launcher.prepare generates it
                    out.findings.append(Finding(key=key, problem=f"file not found: {shown(file)}", fix="make it with 'fleetrl data gsm8k' or 'fleetrl data synth', or set data.synth_task"))  # fmt: skip
                continue
            problems, rows = file_problems(file)
            for problem in problems:
                where = shown(problem.file)
                if problem.row is not None:
                    where += f": row {problem.row}"
                if problem.field is not None and problem.row is not None:
                    where += f": field {problem.field!r}"
                out.findings.append(Finding(key=key, problem=f"{where}: {problem.problem}", fix=DATA_FIX))  # fmt: skip
            out.samples += [(key, file, index, row) for index, row in enumerate(rows[:RENDERED_ROWS])]  # fmt: skip
    return out


def check_rendering(cfg: RunConfig, samples: list[tuple[str, str, int, dict[str, Any]]]) -> list[Finding]:  # fmt: skip
    """Render the sampled prompts as the rollout will (tokenizer, template, length, multi-turn)."""
    if not samples:
        return []
    plain = [s for s in samples if isinstance(s[3]["prompt"], str)]
    if cfg.rollout.multi_turn.enabled and plain:
        key, file, index, _ = plain[0]
        return [Finding(key=key, problem=f"{shown(file)}: row {index}: the prompt is a plain string; rollout.multi_turn.env converses in chat messages", fix="give the prompts as [{role, content}] messages, or leave rollout.multi_turn.env empty")]  # fmt: skip
    if not (Path(cfg.model.path) / "config.json").is_file():
        return []  # model.create_tiny builds it at start (its tokenizer has a template)
    from fleetrl.models.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.model.path)
    except (OSError, ValueError) as err:
        return [Finding(key="model.path", problem=f"the tokenizer in {shown(cfg.model.path)} does not load: {_first_line(err)}", fix="give model.path a Hugging Face folder with its tokenizer files")]  # fmt: skip
    chat = [s for s in samples if not isinstance(s[3]["prompt"], str)]
    if cfg.data.apply_chat_template and chat and not getattr(tokenizer, "chat_template", None):
        key, file, _, _ = chat[0]
        return [Finding(key="data.apply_chat_template", problem=f"true, and the tokenizer in {shown(cfg.model.path)} has no chat template to render the chat prompts of {shown(file)}", fix="set data.apply_chat_template=false (a prompt's message contents are then joined by newlines), or give the tokenizer a chat_template")]  # fmt: skip
    return _render_samples(cfg, tokenizer, samples)


def _render_samples(cfg: RunConfig, tokenizer: Any, samples: list[tuple[str, str, int, dict[str, Any]]]) -> list[Finding]:  # fmt: skip
    from fleetrl.data.reader import render_prompt

    data = cfg.data
    for key, file, index, row in samples:
        try:
            ids = render_prompt(tokenizer, row["prompt"], data.apply_chat_template)
        except Exception as err:  # noqa: BLE001 - the user's template code: its error, quoted
            how = "with the chat template" if data.apply_chat_template else "as text"
            return [Finding(key=key, problem=f"{shown(file)}: row {index}: rendering the prompt {how} raised {type(err).__name__}: {_first_line(err)}", fix="fix the tokenizer's chat_template or the prompt, or set data.apply_chat_template=false")]  # fmt: skip
        if data.truncation == "error" and len(ids) > data.max_prompt_length:
            return [Finding(key="data.max_prompt_length", problem=f"{shown(file)}: row {index}: the prompt renders to {len(ids)} tokens, more than {data.max_prompt_length}, and data.truncation=error refuses it", fix="raise data.max_prompt_length, or set data.truncation to filter, left, right or middle")]  # fmt: skip
    return []


def check_data(cfg: RunConfig) -> tuple[list[Finding], DataRows]:
    """Every problem of the prompt files and of rendering them; the rows read."""
    rows = data_rows(cfg)
    return rows.findings + check_rendering(cfg, rows.samples), rows
