"""The weight group an engine forms outside torch's registry serves the same devices as
the group torch's own helper forms (SGLang's ``init_custom_process_group`` path).

An engine on a GPU whose learner shares the device joins a gloo group and receives
CUDA tensors through it; a group that registered gloo for the CPU alone refused them
("No backend type associated with device type cuda") on the first GPU run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from learner.dist import indexed
from weight_sync.group import _sglang_style_group


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True)


def test_an_unregistered_gloo_group_serves_the_devices_torchs_helper_registers(store):
    registered = _sglang_style_group(store, "helper", 0, 1, "gloo", 10, register=True)
    ours = _sglang_style_group(store, "ours", 0, 1, "gloo", 10, register=False)
    try:
        assert (
            set(ours._device_types)
            == set(registered._device_types)
            == {
                torch.device("cpu"),
                torch.device("cuda"),
            }
        )
        # one gloo backend for both, as torch registers it
        assert ours._get_backend(torch.device("cuda")) is ours._get_backend(torch.device("cpu"))
        tensor = torch.arange(4.0)
        ours.broadcast([tensor]).wait()
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group(registered)


def test_a_cuda_device_without_an_index_is_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")
