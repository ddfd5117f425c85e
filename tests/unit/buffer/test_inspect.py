"""`fleetrl inspect rollouts`: counts and staleness read back from a bank."""

from __future__ import annotations

import argparse
import io

import pytest

from buffer.config import BufferConfig
from buffer.core import BufferCore
from buffer.inspect import main, render, summarize
from buffer.synthetic import make_group, make_trajectory


def test_summary_counts_groups_handouts_and_staleness(tmp_path, capsys):
    core = BufferCore(
        BufferConfig(max_staleness=2),
        bank_dir=tmp_path,
        groups_per_version=1,
        max_concurrent_groups=4,
    )
    core.ingest(
        make_group("a", 2, version=0) + make_group("b", 2, version=1) + make_group("c", 3)[:1]
    )
    core.publish_version(2)
    core.take_batch(2, learner_version=2)
    core.commit(2)
    summary = summarize(tmp_path)
    assert summary["samples"] == 5
    assert (summary["complete_groups"], summary["partial_groups"]) == (2, 1)
    assert summary["handouts"] == 2 and summary["committed_watermark"] == 2
    assert summary["staleness_histogram"] == {1: 1, 2: 1}
    assert summary["policy_version"] == 2
    out = io.StringIO()
    render(summary, out)
    assert "staleness at hand-out" in out.getvalue()
    assert main(argparse.Namespace(dir=str(tmp_path))) == 0
    assert "hand-outs 2" in capsys.readouterr().out


def test_missing_folder_exits_2_with_a_message(tmp_path, capsys):
    assert main(argparse.Namespace(dir=str(tmp_path / "nope"))) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_trained_token_fraction_counts_the_policys_own_tokens(tmp_path):
    core = BufferCore(
        BufferConfig(max_staleness=2), bank_dir=tmp_path, groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    core.ingest(
        [
            make_trajectory("t", 0, 2, response_len=4, loss_mask=[1, 0, 0, 1]),
            make_trajectory("t", 1, 2, response_len=4),
        ]
    )
    summary = summarize(tmp_path)
    assert summary["trained_token_fraction"] == 6 / 8
    out = io.StringIO()
    render(summary, out)
    assert "trained token fraction   0.750" in out.getvalue()


def test_json_prints_each_accepted_trajectory_once_with_its_episode(tmp_path, capsys):
    import json

    import msgspec

    bank = tmp_path / "rollout_bank"  # a run directory: its bank is found inside
    core = BufferCore(
        BufferConfig(max_staleness=2), bank_dir=bank, groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    branch = msgspec.structs.replace(
        make_trajectory("g", 0, 2, prompt_len=3, response_len=4, version=5, loss_mask=[1, 0, 0, 1]),
        episode="g/e0", reward_error="",
    )  # fmt: skip
    failed = msgspec.structs.replace(make_trajectory("g", 1, 2), reward_error="scorer raised")
    core.ingest([branch, failed])
    core.ingest([branch])  # a resend: the buffer counts it duplicate; printed once
    assert main(argparse.Namespace(dir=str(tmp_path), json=True)) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["uid"] for r in lines] == ["g/0", "g/1"]
    first = lines[0]
    assert first["episode"] == "g/e0" and first["prompt_length"] == 3
    assert (
        first["token_ids"]
        == branch.prompt_ids.numpy().tolist() + branch.response_ids.numpy().tolist()
    )
    assert first["loss_mask"] == [0, 0, 0, 1, 0, 0, 1]
    assert first["versions"] == [-1, -1, -1, 5, 5, 5, 5]
    assert first["logprobs"][:3] == [0.0] * 3 and first["logprobs"][4:6] == [0.0, 0.0]
    assert first["reward"] == pytest.approx(branch.score, abs=1e-6)
    assert lines[1]["reward"] is None and lines[1]["reward_error"] == "scorer raised"
    (tmp_path / "empty").mkdir()
    assert main(argparse.Namespace(dir=str(tmp_path / "empty"), json=True)) == 2
    assert "holds no rollout bank" in capsys.readouterr().err


def test_a_run_folder_reads_its_bank_and_a_folder_without_one_is_an_error(tmp_path, capsys):
    run = tmp_path / "run"
    core = BufferCore(
        BufferConfig(max_staleness=2), bank_dir=run / "rollout_bank", groups_per_version=1,
        max_concurrent_groups=4,
    )  # fmt: skip
    core.ingest(make_group("a", 2, version=0))
    assert main(argparse.Namespace(dir=str(run))) == 0
    assert "samples 2" in " ".join(capsys.readouterr().out.split())
    assert summarize(run)["samples"] == summarize(run / "rollout_bank")["samples"] == 2
    (tmp_path / "empty").mkdir()
    assert main(argparse.Namespace(dir=str(tmp_path / "empty"))) == 2
    assert "holds no rollout bank" in capsys.readouterr().err
