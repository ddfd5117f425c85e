"""Two FSDP2 learner ranks (gloo) publish to engines in separate processes; engines end bit-exact.

Rank 0 owns the ``WeightSender``; both ranks walk the sharded model with
``DTensor.full_tensor()`` (the collective ``named_full_tensors`` of the learner),
rank 1 just drains its walk. A third engine is added after version 0 and must
hold version 1 like the others. An engine that dies mid-sync is named in the
error and the learner returns (pytest-timeout fails the test on a hang).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.weight_sync._engines import reference_engines

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _named_full_tensors(model):
    """The learner's collective walk: state_dict order, parameters and persistent buffers, full tensors."""
    wanted = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    for name, tensor in model.state_dict().items():
        if name in wanted:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, full.detach()


def _learner_rank(rank: int, world: int, port: int, model_dir: str, work: str, urls: dict) -> None:
    import requests
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from fleetrl.log import setup_logging
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender, drain_stream

    setup_logging(role=f"learner-{rank}")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    sender = None
    if rank == 0:
        sender = WeightSender(WeightSyncConfig(bucket_mb=0.05, timeout_s=30))  # several buckets
        sender.connect([EngineEndpoint(n, urls[n], None) for n in ("e0", "e1")])
    results = {}
    for version in range(2):
        with torch.no_grad():  # a "training step": every shard moves
            for param in model.parameters():
                param.add_(0.01 * (version + 1) * (rank + 1))
        if rank == 0:
            if version == 1:
                sender.add_engine(EngineEndpoint("late", urls["late"], None))
            metrics = sender.publish(_named_full_tensors(model), version)
            results[version] = {"engines": sorted(metrics.engines), "buckets": metrics.num_buckets}
        else:
            drain_stream(_named_full_tensors(model))
        expected = {n: t.clone() for n, t in _named_full_tensors(model)}  # collective on both ranks
        if rank == 0:
            save_file(expected, f"{work}/learner_v{version}.safetensors")
            for name in results[version]["engines"]:
                requests.post(
                    urls[name] + "/fleetrl/reference/save",
                    json={"path": f"{work}/{name}_v{version}.safetensors"},
                    timeout=30,
                ).raise_for_status()
    if rank == 0:
        sender.close()
        Path(work, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _assert_same_file(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    left, right = load_file(str(a)), load_file(str(b))
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype
        assert torch.equal(left[name].view(torch.uint8), right[name].view(torch.uint8)), name


def test_two_fsdp_ranks_sync_engines_bit_exact_and_a_late_engine_catches_up(
    tiny_model_dir, tmp_path
):
    import requests
    import torch.multiprocessing as mp

    specs = {n: ["--model", str(tiny_model_dir)] for n in ("e0", "e1", "late")}
    with reference_engines(specs, tmp_path) as engines:
        urls = {n: e.url for n, e in engines.items()}
        ctx = mp.get_context("spawn")
        port = _free_port()
        env_before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            procs = [
                ctx.Process(
                    target=_learner_rank,
                    args=(r, 2, port, str(tiny_model_dir), str(tmp_path), urls),
                )
                for r in range(2)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(200)
        finally:
            if env_before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_before
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0, 0]
        results = json.loads((tmp_path / "results.json").read_text())
        assert results["0"]["engines"] == ["e0", "e1"] and results["0"]["buckets"] > 1
        assert results["1"]["engines"] == ["e0", "e1", "late"]
        for version, names in ((0, ["e0", "e1"]), (1, ["e0", "e1", "late"])):
            for name in names:
                _assert_same_file(
                    tmp_path / f"learner_v{version}.safetensors",
                    tmp_path / f"{name}_v{version}.safetensors",
                )
        for url in urls.values():
            assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == "1"


def test_engine_killed_mid_sync_is_named_and_the_learner_does_not_hang(tmp_path):
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender, WeightSyncError

    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([[n, "float32", list(t.shape)] for n, t in weights.items()]))
    specs = {
        "steady": ["--spec", str(spec), "--group-timeout-s", "10"],
        "doomed": ["--spec", str(spec), "--die-on-update", "3", "--group-timeout-s", "10"],
    }
    config = WeightSyncConfig(bucket_mb=0.02, timeout_s=10)
    with reference_engines(specs, tmp_path) as engines, WeightSender(config) as sender:
        sender.connect([EngineEndpoint(n, e.url, None) for n, e in engines.items()])
        consumed = []

        def stream():
            for item in weights.items():
                consumed.append(item[0])
                yield item

        with pytest.raises(WeightSyncError, match="engine doomed") as info:
            sender.publish(stream(), 0)
        assert engines["doomed"].proc.wait(timeout=10) != 0
        assert info.value.engines == ["doomed"] and info.value.partial == ["steady"]
        assert consumed == list(weights)  # drained: other FSDP ranks never block
        assert sender.engines == ["steady"]
        metrics = sender.publish(weights.items(), 1)  # the group is rebuilt without it
        assert list(metrics.engines) == ["steady"] and metrics.engines["steady"].verified


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
