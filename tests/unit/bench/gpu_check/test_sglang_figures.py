"""The SGLang stages' figure helpers (bench.gpu.sglang_stages) on made-up inputs: the stages
themselves run only on a machine with SGLang's CUDA engine."""

from __future__ import annotations

import pytest

from bench.gpu import sglang_stages


def test_logprob_figures_report_the_largest_and_mean_difference():
    figures = sglang_stages.logprob_figures([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.25]])
    assert figures["tokens"] == 3
    assert figures["max_abs_diff"] == pytest.approx(0.25)
    assert figures["mean_abs_diff"] == pytest.approx(0.35 / 3)
    with pytest.raises(ValueError, match="engine gave 2 logprobs, learner 1"):
        sglang_stages.logprob_figures([[-1.0, -2.0]], [[-1.0]])


def test_sync_figures_are_medians_and_ratios_to_the_baselines():
    figures = sglang_stages.sync_figures([10.0, 12.0, 11.0], [20.0, 22.0, 24.0], [2.0, 2.5, 3.0])
    assert figures["bucket_gbps"] == 11.0
    assert figures["raw_broadcast_gbps"] == 22.0
    assert figures["bucket_vs_raw"] == pytest.approx(0.5)
    assert figures["bucket_vs_per_tensor"] == pytest.approx(4.4)
    missing = sglang_stages.sync_figures([10.0], [], [])
    assert missing["bucket_vs_raw"] is None and missing["per_tensor_gbps"] is None


def test_every_sglang_and_vllm_stage_has_headline_figures_named():
    from bench.gpu import vllm_stages
    from bench.gpu.plan import SGLANG_STAGE_NAMES, VLLM_STAGE_NAMES

    assert set(sglang_stages.HEADLINES) == set(SGLANG_STAGE_NAMES)
    assert vllm_stages.STAGE_NAMES == VLLM_STAGE_NAMES
