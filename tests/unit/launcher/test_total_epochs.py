"""trainer.total_epochs becomes a step count as verl computes it: ⌊prompts ÷ batch⌋ per epoch
(its train dataloader drops the last partial batch), the prompts the reader keeps."""

from __future__ import annotations

import pytest

from fleetrl.config import ConfigError
from fleetrl.data.schema import write_rows
from launcher.config import load_run_config
from launcher.prepare import count_train_prompts, resolve_total_steps


def _row(content: str) -> dict:
    return {
        "data_source": "synth/add",
        "prompt": [{"role": "user", "content": content}],
        "ability": "synth",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"split": "train", "index": 0},
    }


@pytest.fixture
def train_file(tmp_path):
    # 21 short prompts and 2 longer than max_prompt_length=40 below
    rows = [_row(f"{i}+1=") for i in range(21)] + [_row("y" * 300)] * 2
    return write_rows(rows, tmp_path / "train.parquet")


def _cfg(model_dir, train_file, *overrides):
    return load_run_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train_files={train_file}",
            "data.train_batch_size=4",
            "data.max_prompt_length=40",
            "trainer.total_epochs=3",
            *overrides,
        ],
    )


def test_steps_are_epochs_times_whole_batches_of_the_prompts_kept(tiny_model_dir, train_file):
    cfg = _cfg(tiny_model_dir, train_file)
    assert count_train_prompts(cfg) == 21  # the 2 over-long prompts are filtered
    assert resolve_total_steps(cfg).trainer.total_steps == 3 * (21 // 4)
    # verl's default truncation keeps every row: 23 prompts, still 5 whole batches
    truncated = _cfg(tiny_model_dir, train_file, "data.truncation=left")
    assert count_train_prompts(truncated) == 23
    assert resolve_total_steps(truncated).trainer.total_steps == 15
    capped = _cfg(tiny_model_dir, train_file, "data.truncation=left", "data.train_max_samples=9")
    assert resolve_total_steps(capped).trainer.total_steps == 3 * 2


def test_without_epochs_total_steps_stands_and_too_few_prompts_name_the_key(
    tiny_model_dir, train_file
):
    cfg = _cfg(tiny_model_dir, train_file, "trainer.total_epochs=0", "trainer.total_steps=7")
    assert resolve_total_steps(cfg).trainer.total_steps == 7
    with pytest.raises(ConfigError, match=r"trainer\.total_epochs.*fewer than one batch"):
        resolve_total_steps(_cfg(tiny_model_dir, train_file, "data.train_batch_size=64"))
