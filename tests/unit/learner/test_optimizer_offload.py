"""learner.optimizer_offload: the update streamed chunk by chunk is AdamW's own, bit for bit,
and between steps the state lives on the host.

On the CPU host and device are one memory, so the moves return the tensors themselves;
everything else is the path a GPU takes (chunks, set-aside gradients, the moves' calls).
The GPU check measures the device memory it frees (bench/gpu/stages.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from learner.fsdp import guarded_step
from learner.optimizer_offload import OffloadedOptimizer, offload_for, state_bytes


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """guarded_step's all-reduce: a group of one (gloo), as a one-rank learner has."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 50))


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    tokens = torch.randint(0, 50, (4, 6))
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, 50), tokens.roll(1, 1).reshape(-1))


def test_the_chunked_update_is_adamws_own_and_the_state_stays_on_the_host():
    plain, streamed = _model(), _model()
    plain_opt = _adamw(plain)
    offloaded = OffloadedOptimizer(_adamw(streamed), "cpu", chunk_bytes=2 * 4 * (16 * 32 + 32))
    params = list(streamed.parameters())
    chunks = offloaded.chunks(params)
    assert len(chunks) == 4 and [len(c) for c in chunks] == [1, 2, 1, 1]  # by state bytes
    assert all(sum(state_bytes(p) for p in c) <= offloaded.chunk_bytes or len(c) == 1 for c in chunks)  # fmt: skip
    for step in range(3):
        for model, optimizer in ((plain, plain_opt), (streamed, offloaded)):
            _loss(model, step).backward()
            update = guarded_step(model, optimizer, 1.0, torch.zeros(()))
            assert update.stepped
            assert all(p.grad is None for p in model.parameters())  # zeroed either way
        for a, b in zip(plain.parameters(), streamed.parameters(), strict=True):
            assert torch.equal(a, b)
        assert offloaded.state_devices() == {torch.device("cpu")}  # between steps: the host
    assert offloaded.chunks_stepped == 3 * len(chunks)
    for p_plain, p_streamed in zip(plain.parameters(), params, strict=True):
        a, b = plain_opt.state[p_plain], offloaded.optimizer.state[p_streamed]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])


def test_a_skipped_step_leaves_every_gradient_where_it_was_and_nothing_stepped():
    model = _model()
    offloaded = OffloadedOptimizer(_adamw(model), "cpu", chunk_bytes=1)
    before = [p.detach().clone() for p in model.parameters()]
    update = guarded_step(model, offloaded, 1.0, torch.tensor(float("nan")))
    assert not update.stepped and offloaded.chunks_stepped == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_offload_is_made_only_when_asked_and_fsdp_does_not_keep_the_state_on_the_host():
    opt = _adamw(_model())
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert offload_for(opt, cpu, enabled=False, param_offload=False, chunk_mb=1) is None
    made = offload_for(opt, cpu, enabled=True, param_offload=False, chunk_mb=2)
    assert isinstance(made, OffloadedOptimizer) and made.chunk_bytes == 2 * 2**20
    # GPU with param_offload: FSDP's CPUOffloadPolicy steps on the host already
    assert offload_for(opt, gpu, enabled=True, param_offload=True, chunk_mb=1) is None
