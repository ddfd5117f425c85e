"""PromptReader: chat template, length filtering, deterministic epochs, exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from fleetrl.data.reader import PromptReader, render_prompt
from fleetrl.data.schema import DatasetError, write_rows
from fleetrl.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _row(content: str, answer: str, index: int) -> dict:
    return {
        "data_source": "synth/add",
        "prompt": [{"role": "user", "content": content}],
        "ability": "synth",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


@pytest.fixture
def files(tmp_path):
    first = write_rows([_row(f"{i}+1=", str(i + 1), i) for i in range(6)], tmp_path / "a.parquet")
    second = write_rows(
        [_row(f"{i}+2=", str(i + 2), i) for i in range(4)] + [_row("x" * 200, "0", 4)],
        tmp_path / "b.parquet",
    )
    return [first, second]


def _contents(items) -> list[str]:
    return [item.raw_prompt[0]["content"] for item in items]


def test_items_carry_templated_ids_and_reward_fields(files, tokenizer):
    reader = PromptReader(files, tokenizer, max_prompt_length=64, shuffle=False)
    item = next(reader)
    assert item.index == 0
    assert item.prompt_ids.dtype == np.int32
    assert tokenizer.decode(item.prompt_ids.tolist()) == (
        "<|im_start|>user\n0+1=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (item.data_source, item.ground_truth) == ("synth/add", "1")
    assert item.extra_info == {"split": "train", "index": 0}
    assert (item.file, item.row) == (str(files[0]), 0)

    plain = PromptReader(files, tokenizer, max_prompt_length=64, apply_chat_template=False)
    assert tokenizer.decode(next(plain).prompt_ids.tolist()) in {f"{i}+1=" for i in range(6)} | {
        f"{i}+2=" for i in range(4)
    }


def test_prompts_over_max_length_are_filtered_and_counted(files, tokenizer):
    reader = PromptReader(files, tokenizer, max_prompt_length=64)
    assert reader.num_filtered == 1
    assert len(reader) == 10
    assert all(len(item.prompt_ids) <= 64 for item in reader.take(30))
    with pytest.raises(DatasetError, match="no prompts left: all 11 are longer"):
        PromptReader(files, tokenizer, max_prompt_length=5)


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order(files, tokenizer):
    reader = PromptReader(files, tokenizer, max_prompt_length=64, seed=7)
    epoch0, epoch1 = _contents(reader.take(10)), _contents(reader.take(10))
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 10
    assert epoch0 != epoch1  # a new permutation per epoch
    again = PromptReader(files, tokenizer, max_prompt_length=64, seed=7)
    assert _contents(again.take(20)) == epoch0 + epoch1
    other = PromptReader(files, tokenizer, max_prompt_length=64, seed=8)
    assert _contents(other.take(10)) != epoch0
    unshuffled = PromptReader(files, tokenizer, max_prompt_length=64, shuffle=False)
    assert _contents(unshuffled.take(10))[:3] == ["0+1=", "1+1=", "2+1="]


def test_resume_from_state_dict_continues_with_the_same_next_prompt(files, tokenizer):
    reference = PromptReader(files, tokenizer, max_prompt_length=64, seed=3)
    expected = reference.take(25)

    reader = PromptReader(files, tokenizer, max_prompt_length=64, seed=3)
    reader.take(13)  # into the second epoch
    state = reader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)

    resumed = PromptReader(files, tokenizer, max_prompt_length=64, seed=3)
    resumed.load_state_dict(state)
    rest = resumed.take(12)
    assert [i.index for i in rest] == list(range(13, 25))
    assert _contents(rest) == _contents(expected[13:])

    resumed.seek(4)
    assert _contents([next(resumed)]) == _contents(expected[4:5])


def test_state_from_a_different_dataset_setup_is_refused(files, tokenizer):
    state = PromptReader(files, tokenizer, max_prompt_length=64, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed=3 but this reader has seed=4"):
        PromptReader(files, tokenizer, max_prompt_length=64, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts=10 but this reader has num_prompts=6"):
        PromptReader(files[:1], tokenizer, max_prompt_length=64, seed=3).load_state_dict(state)


def test_iter_once_walks_file_order_and_leaves_the_cursor_alone(files, tokenizer):
    reader = PromptReader(files, tokenizer, max_prompt_length=64)
    first = next(reader)
    assert _contents(reader.iter_once()) == [f"{i}+1=" for i in range(6)] + [
        f"{i}+2=" for i in range(4)
    ]
    assert [i.index for i in reader.iter_once(max_samples=3)] == [0, 1, 2]
    assert reader.cursor == 1 and first.index == 0


def test_bad_file_fails_at_construction_naming_the_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = _row("1+1=", "2", 0)
    bad["prompt"] = [{"role": "user", "content": None}]
    pq.write_table(pa.Table.from_pylist([_row("1+1=", "2", 0), bad]), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"row 1: field 'prompt\[0\].content'"):
        PromptReader([tmp_path / "bad.parquet"], tokenizer, max_prompt_length=64)


def test_over_long_prompts_truncated_as_verl_or_refused_naming_file_and_row(files, tokenizer):
    full = render_prompt(tokenizer, [{"role": "user", "content": "x" * 200}], True)
    assert len(full) > 64
    by_mode = {}
    for mode in ("left", "right", "middle"):
        reader = PromptReader(
            files, tokenizer, max_prompt_length=64, shuffle=False, truncation=mode
        )
        assert len(reader) == 11 and reader.num_truncated == 1 and reader.num_filtered == 0
        by_mode[mode] = list(reader.iter_once())[-1].prompt_ids.tolist()
    assert by_mode["left"] == full[-64:]  # verl's left: the end survives
    assert by_mode["right"] == full[:64]
    assert by_mode["middle"] == full[:32] + full[-32:]
    with pytest.raises(DatasetError, match=r"b\.parquet row 4.*data\.truncation"):
        PromptReader(files, tokenizer, max_prompt_length=64, truncation="error")
    with pytest.raises(ValueError, match="truncation must be one of"):
        PromptReader(files, tokenizer, max_prompt_length=64, truncation="drop")


def test_max_samples_keeps_a_seeded_choice_or_the_first_rows(files, tokenizer):
    first = PromptReader(files, tokenizer, max_prompt_length=64, shuffle=False, max_samples=4)
    assert _contents(first.iter_once()) == ["0+1=", "1+1=", "2+1=", "3+1="]
    picks = [
        _contents(
            PromptReader(
                files, tokenizer, max_prompt_length=64, seed=seed, max_samples=4
            ).iter_once()
        )  # fmt: skip
        for seed in (3, 3, 4)
    ]
    assert len(picks[0]) <= 4 and picks[0] == picks[1] != picks[2]
    every = PromptReader(files, tokenizer, max_prompt_length=64, shuffle=False, max_samples=0)
    assert len(every) == 10  # 0 (and -1) = all rows, as verl; the over-long one filtered


def test_prompts_without_a_template_are_encoded_as_the_tokenizer_encodes_text(tmp_path):
    """A base Llama's prompts start with its BOS, whether the prompt is a plain string or
    chat messages rendered as text; a template's rendering carries its own specials."""
    from tests.unit.fleetrl.tokenizer_kinds import LLAMA2_TEMPLATE, llama_style

    chat, plain = _row("1+1=", "2", 0), {**_row("", "2", 1), "prompt": "Q: 1+1=?\nA:"}
    files = [write_rows([chat], tmp_path / "chat.parquet"), write_rows([plain], tmp_path / "plain.parquet")]  # fmt: skip
    base = llama_style()
    reader = PromptReader(files, base, max_prompt_length=64, shuffle=False, apply_chat_template=False)  # fmt: skip
    items = list(reader.iter_once())
    assert [item.prompt_ids.tolist() for item in items] == [
        base.encode("1+1="),
        base.encode("Q: 1+1=?\nA:"),
    ]
    assert all(item.prompt_ids[0] == base.bos_token_id for item in items)
    assert items[1].raw_prompt == "Q: 1+1=?\nA:"
    templated = llama_style(LLAMA2_TEMPLATE)
    (item, _) = PromptReader(files, templated, max_prompt_length=64, shuffle=False).iter_once()
    ids = item.prompt_ids.tolist()
    assert ids[0] == templated.bos_token_id and ids[1] != templated.bos_token_id  # one BOS
    with pytest.raises(DatasetError, match="chat.parquet: row 0: field 'prompt'.*no chat template"):
        PromptReader(files, base, max_prompt_length=64)
