"""The GPU check's co-located stage (``bench.colocated_check``), run on CPU: the engine in a
process of its own releases its memory (its RSS drops by about the weights), takes the
push by shared-memory handle and serves version 1; the learner's offload is a no-op here."""

from __future__ import annotations

import pytest

from bench.colocated_check import check_colocated

pytestmark = pytest.mark.timeout(900)


def test_the_colocated_stage_passes_on_cpu_with_its_figures(tmp_path):
    figures: dict = {}
    assert check_colocated(tmp_path, figures, device="cpu"), figures
    assert figures["served_version"] == "1"
    assert figures["device_bytes_freed"] >= 0.8 * figures["push_bytes"] > 0
    assert figures["forward_unchanged"] is True and figures["offload_s"] == 0.0
    for key in ("release_s", "resume_weights_s", "push_s", "resume_kv_s", "push_gbps"):
        assert figures[key] >= 0.0


@pytest.mark.gpu
def test_the_colocated_stage_frees_device_memory_and_loads_cuda_ipc_handles(tmp_path):
    """On CUDA: the engine's release gives device memory back, the push arrives by CUDA IPC
    handle, and the FSDP2 learner's offload frees its device memory."""
    figures: dict = {}
    assert check_colocated(tmp_path, figures, device="cuda"), figures
    assert figures["device_bytes_freed"] >= 0.8 * figures["push_bytes"] > 0
    assert figures["learner_bytes_freed"] > 0 and figures["forward_unchanged"] is True
