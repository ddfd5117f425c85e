"""SampleProgress and build_trajectory: abort-resubmit concatenation keeps every piece exact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from buffer.wire import decode_trajectory, encode
from rollout_fleet.trajectory import InconsistentPieceError, SampleProgress, build_trajectory


@dataclass
class Piece:
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str


def test_abort_then_resubmit_concatenates_tokens_logprobs_and_versions():
    sample = SampleProgress([1, 2, 3], max_new_tokens=6)
    sample.add(Piece([10, 11], [-0.1, -0.2], [0, 0], "abort"), "e0")
    assert not sample.finished
    assert sample.remaining_tokens == 4
    assert sample.resume_input_ids() == [1, 2, 3, 10, 11]
    sample.add(Piece([12, 13, 14], [-0.3, -0.4, -0.5], [1, 1, 1], "stop"), "e1")
    assert sample.finished
    traj = build_trajectory(sample, group_id="p7", sample_index=2, group_size=4, score=1.0)
    assert traj.uid == "p7/2"
    assert traj.response_ids.numpy().tolist() == [10, 11, 12, 13, 14]
    assert np.allclose(traj.behavior_logprobs.numpy(), [-0.1, -0.2, -0.3, -0.4, -0.5])
    assert traj.token_versions.numpy().tolist() == [0, 0, 1, 1, 1]
    assert traj.min_version() == 0
    assert traj.finish_reason == "stop"
    assert traj.engine_id == "e0+e1"
    assert traj.prompt_ids.numpy().tolist() == [1, 2, 3]
    assert sample.aborted_pieces == 1 and sample.pieces == 2


def test_an_abort_with_no_tokens_just_resubmits():
    sample = SampleProgress([1], max_new_tokens=3)
    sample.add(Piece([], [], [], "abort"))
    assert not sample.finished and sample.remaining_tokens == 3
    sample.add(Piece([5, 6, 7], [-1.0] * 3, [2] * 3, "length"))
    assert sample.final_finish_reason == "length"


def test_abort_that_used_the_whole_budget_finishes_as_length():
    sample = SampleProgress([1], max_new_tokens=2)
    sample.add(Piece([5, 6], [-1.0, -1.0], [0, 0], "abort"))
    assert sample.finished
    assert sample.final_finish_reason == "length"


def test_tokens_beyond_the_budget_are_cut_and_the_sample_ends_as_length():
    sample = SampleProgress([1], max_new_tokens=3)
    sample.add(Piece([5], [-1.0], [0], "abort"))
    taken = sample.add(Piece([6, 7, 8, 9], [-1.0] * 4, [1] * 4, "stop"))
    assert taken == 2
    assert sample.output_ids == [5, 6, 7]
    assert sample.token_versions == [0, 1, 1]
    assert sample.final_finish_reason == "length"


def test_piece_with_inconsistent_lengths_is_rejected_naming_the_engine():
    sample = SampleProgress([1], max_new_tokens=3)
    with pytest.raises(InconsistentPieceError, match="engine-3"):
        sample.add(Piece([5, 6], [-1.0], [0, 0], "stop"), "engine-3")
    assert sample.output_ids == []


def test_adding_to_a_finished_sample_is_an_error():
    sample = SampleProgress([1], max_new_tokens=3)
    sample.add(Piece([5], [-1.0], [0], "stop"))
    with pytest.raises(ValueError, match="already finished"):
        sample.add(Piece([6], [-1.0], [0], "stop"))


def test_unfinished_sample_cannot_become_a_trajectory():
    sample = SampleProgress([1], max_new_tokens=3)
    sample.add(Piece([5], [-1.0], [0], "abort"))
    with pytest.raises(ValueError, match="unfinished"):
        build_trajectory(sample, group_id="g", sample_index=0, group_size=1, score=0.0)


def test_empty_prompt_or_zero_budget_is_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        SampleProgress([], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SampleProgress([1], max_new_tokens=0)


def test_trajectory_carries_metadata_and_survives_the_wire():
    sample = SampleProgress([4, 5], max_new_tokens=4)
    sample.add(Piece([7, 8], [-0.5, -0.25], [3, 3], "stop"), "engine-1")
    traj = build_trajectory(
        sample,
        group_id="p3",
        sample_index=0,
        group_size=2,
        score=0.5,
        data_source="synth/add",
        prompt_index=3,
        reward_metrics={"acc": 1.0},
        timings={"generate_s": 0.1, "reward_s": 0.01},
        temperature=0.7,
    )
    back = decode_trajectory(encode(traj))
    assert back.group_id == "p3" and back.group_size == 2
    assert back.score == 0.5 and back.data_source == "synth/add" and back.prompt_index == 3
    assert back.reward_metrics == {"acc": 1.0}
    assert back.timings == {"generate_s": 0.1, "reward_s": 0.01}
    assert back.temperature == pytest.approx(0.7)
    assert back.engine_id == "engine-1"
    assert back.token_versions.numpy().tolist() == [3, 3]
