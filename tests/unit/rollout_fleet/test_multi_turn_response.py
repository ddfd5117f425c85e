"""A multi-turn response in one SampleProgress: turns, environment tokens, mask, budget, wire."""

from __future__ import annotations

import pytest

from rollout_fleet.trajectory import SampleProgress, build_trajectory
from tests.unit.rollout_fleet.test_trajectory import Piece


def turn(prompt, ids, version, reason="stop"):
    sample = SampleProgress(prompt, 100)
    sample.add(Piece(ids, [-0.5] * len(ids), [version] * len(ids), reason), "e0")
    return sample


def wire(response):
    return build_trajectory(response, group_id="g", sample_index=0, group_size=1, score=0.0)


def test_env_tokens_get_mask_0_logprob_0_and_the_previous_version():
    response = SampleProgress([1, 2], 12)
    response.add_turn(turn(response.resume_input_ids(), [10, 11], version=3))
    assert response.add_env_tokens([50, 51, 52]) == 3
    response.add_turn(turn(response.resume_input_ids(), [12], version=4))
    response.finish("stop")
    assert response.output_ids == [10, 11, 50, 51, 52, 12]
    assert response.loss_mask == [1, 1, 0, 0, 0, 1]
    assert response.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5]
    assert response.token_versions == [3, 3, 3, 3, 3, 4]
    assert response.num_env_tokens == 3 and response.pieces == 2
    traj = wire(response)
    assert traj.loss_mask is not None and traj.loss_mask.dtype == "uint8"
    assert traj.loss_mask.numpy().tolist() == [1, 1, 0, 0, 0, 1]
    assert traj.finish_reason == "stop" and traj.min_version() == 3


def test_env_tokens_are_cut_at_the_budget_of_the_whole_response():
    response = SampleProgress([1], 5)
    response.add_turn(turn([1], [10, 11], version=0))
    assert response.add_env_tokens([50, 51, 52, 53]) == 3
    assert response.remaining_tokens == 0 and response.output_ids == [10, 11, 50, 51, 52]
    response.finish("length")
    assert wire(response).finish_reason == "length"


def test_a_response_without_env_tokens_has_no_mask_on_the_wire():
    response = SampleProgress([1], 5)
    response.add_turn(turn([1], [10], version=0))
    response.finish("stop")
    assert wire(response).loss_mask is None


def test_a_response_starts_with_a_generated_turn_and_turns_fit_the_budget():
    with pytest.raises(ValueError, match="starts with a generated turn"):
        SampleProgress([1], 5).add_env_tokens([50])
    response = SampleProgress([1], 2)
    with pytest.raises(ValueError, match="exceeds the 2 left"):
        response.add_turn(turn([1], [10, 11, 12], version=0))
    with pytest.raises(ValueError, match="accepted: stop, length"):
        response.finish("abort")
