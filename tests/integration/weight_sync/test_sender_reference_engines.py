"""WeightSender against reference engines in this process (gloo on loopback): the protocol end to end.

Each engine is a ``ReferenceEngine`` serving HTTP from a thread, so these run in
seconds; the multi-process FSDP and crash tests live next to this file.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from weight_sync.config import WeightSyncConfig
from weight_sync.reference_engine import ReferenceEngine
from weight_sync.sender import EngineEndpoint, WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(120)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=gen),
        "layers.0.proj.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(16, generator=gen),
        "layers.1.proj.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
        "head.weight": torch.randn(50, 16, generator=gen),
    }


class _Engines:
    def __init__(self) -> None:
        self.engines: dict[str, ReferenceEngine] = {}

    def start(self, name: str, engine_cls=ReferenceEngine, **kwargs) -> EngineEndpoint:
        zeros = {n: torch.zeros_like(t) for n, t in _weights(0).items()}
        engine = engine_cls(zeros, group_timeout_s=kwargs.pop("group_timeout_s", 10.0), **kwargs)
        self.engines[name] = engine
        return EngineEndpoint(name, engine.start_server(), engine.api_key)

    def stop(self) -> None:
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture
def engines():
    pool = _Engines()
    yield pool
    pool.stop()


def _assert_holds(engine: ReferenceEngine, weights: dict[str, torch.Tensor], version: int) -> None:
    assert engine.weight_version == str(version)
    for name, tensor in weights.items():
        held = engine.tensors[name]
        assert held.dtype == tensor.dtype
        assert torch.equal(held.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )


@pytest.mark.parametrize(
    ("load_format", "zero_copy_bytes"),
    [
        ("flattened_bucket", None),  # everything packed (the GPU path)
        ("per_tensor", 0),
        ("flattened_bucket", 512),  # proj, embed, head uncopied beside the norm's bucket
    ],
)
def test_publish_delivers_every_version_bit_exact_in_several_buckets(
    engines, load_format, zero_copy_bytes
):
    endpoints = [engines.start("e0"), engines.start("e1", api_key="secret")]
    config = WeightSyncConfig(bucket_mb=2048 / 2**20, timeout_s=10, load_format=load_format)
    with WeightSender(config) as sender:
        sender.zero_copy_bytes = zero_copy_bytes
        sender.connect(endpoints)
        for version in range(3):
            weights = _weights(version + 1)
            metrics = sender.publish(weights.items(), version)
            for engine in engines.engines.values():
                _assert_holds(engine, weights, version)
                assert engine.paused_mode is None  # continued after the update
            assert metrics.bytes == sum(t.numel() * t.element_size() for t in weights.values())
            assert metrics.num_tensors == len(weights) and metrics.num_buckets > 2
            assert all(s.ok and s.verified for s in metrics.engines.values())
        assert sender.latest_version == 2 and sender.engines == ["e0", "e1"]


def test_a_learner_stream_failing_in_the_first_bucket_aborts_and_the_next_publish_recovers(
    engines,
):
    with WeightSender(WeightSyncConfig(timeout_s=10)) as sender:
        sender.connect([engines.start("e0")])
        sender.publish(_weights(1).items(), 0)

        def failing():
            yield from list(_weights(2).items())[:2]
            raise RuntimeError("gather failed on the learner")

        with pytest.raises(RuntimeError, match="gather failed on the learner"):
            sender.publish(failing(), 1)
        assert sender.group_name is None  # the group was aborted with the session open
        sender.publish(_weights(3).items(), 2)
        _assert_holds(engines.engines["e0"], _weights(3), 2)


def test_engine_added_mid_run_gets_the_full_weights_at_the_next_publish(engines):
    with WeightSender(WeightSyncConfig(timeout_s=10)) as sender:
        sender.connect([engines.start("e0")])
        sender.publish(_weights(1).items(), 0)
        first_group = sender.group_name
        sender.add_engine(engines.start("late"))
        assert (
            engines.engines["late"].weight_version == "default"
        )  # nothing before the next version
        sender.publish(_weights(2).items(), 1)
        assert sender.group_name != first_group  # the group was rebuilt with the new member
        for engine in engines.engines.values():
            _assert_holds(engine, _weights(2), 1)


def test_set_members_follows_the_membership_and_a_replacement_rejoins_the_group(engines):
    e0, e1 = engines.start("e0"), engines.start("e1")
    with WeightSender(WeightSyncConfig()) as sender:
        sender.set_members([e0, e1])
        sender.publish(_weights(1).items(), 0)
        first_group = sender.group_name
        sender.set_members([e0, e1])  # unchanged: the same group serves the next version
        sender.publish(_weights(2).items(), 1)
        assert sender.group_name == first_group
        # e1 replaced by a new process at the same URL: a new member, the group forms again
        sender.set_members([e0, dataclasses.replace(e1, incarnation=7)])
        sender.publish(_weights(3).items(), 2)
        assert sender.group_name != first_group
        _assert_holds(engines.engines["e1"], _weights(3), 2)
        sender.set_members([e0])
        assert sender.engines == ["e0"]
        sender.publish(_weights(4).items(), 3)
        _assert_holds(engines.engines["e0"], _weights(4), 3)
        _assert_holds(engines.engines["e1"], _weights(3), 2)


def test_removed_engine_keeps_its_last_version(engines):
    with WeightSender(WeightSyncConfig(timeout_s=10)) as sender:
        sender.connect([engines.start("e0"), engines.start("e1")])
        sender.publish(_weights(1).items(), 0)
        sender.remove_engine("e1")
        sender.publish(_weights(2).items(), 1)
        _assert_holds(engines.engines["e0"], _weights(2), 1)
        _assert_holds(engines.engines["e1"], _weights(1), 0)
        with pytest.raises(ValueError, match="'e1' is not a weight-sync member"):
            sender.remove_engine("e1")


class _CorruptingEngine(ReferenceEngine):
    def update(self, body):
        reply = super().update(body)
        with self._lock:
            self.tensors["embed.weight"].view(-1)[0] += 1.0
        return reply


def test_verification_names_an_engine_whose_weights_differ(engines):
    with WeightSender(WeightSyncConfig(timeout_s=10)) as sender:
        sender.connect([engines.start("good"), engines.start("bad", _CorruptingEngine)])
        with pytest.raises(
            WeightSyncError, match=r"engine bad: tensor embed.weight differs"
        ) as info:
            sender.publish(_weights(1).items(), 0)
        assert info.value.engines == ["bad"]
        assert info.value.metrics.engines["good"].verified is True


class _HungEngine(ReferenceEngine):
    def update(self, body):
        time.sleep(6)  # never joins the broadcast within the sender's timeout
        return {"success": False, "message": "too late"}


def test_hung_engine_times_out_is_named_and_dropped_and_the_others_continue(engines):
    with WeightSender(WeightSyncConfig(timeout_s=2)) as sender:
        sender.connect([engines.start("ok"), engines.start("hung", _HungEngine)])
        with pytest.raises(WeightSyncError, match="engine hung") as info:
            sender.publish(_weights(1).items(), 0)
        assert info.value.engines == ["hung"]
        assert sender.engines == ["ok"]
        # the survivor got part of v0 at most: it stays paused until a full publish
        assert info.value.partial in ([], ["ok"])
        assert info.value.needs_resend == bool(info.value.partial)
        sender.publish(_weights(2).items(), 1)
        _assert_holds(engines.engines["ok"], _weights(2), 1)


class _RefusingEngine(ReferenceEngine):
    def update(self, body):
        raise ValueError("no backend for these tensors")  # answers at once, never joins


def test_an_engine_refusing_a_bucket_fails_the_version_at_once_not_at_the_timeout(engines):
    with WeightSender(WeightSyncConfig(timeout_s=30)) as sender:
        sender.connect([engines.start("ok"), engines.start("refuses", _RefusingEngine)])
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="no backend for these tensors") as info:
            sender.publish(_weights(1).items(), 0)
        assert time.monotonic() - started < 10  # not the 30 s a broadcast may wait
        assert info.value.engines == ["refuses"]
        assert sender.engines == ["ok"]
        sender.publish(_weights(2).items(), 1)
        _assert_holds(engines.engines["ok"], _weights(2), 1)


def test_unreachable_engine_at_connect_is_named_and_the_group_forms_without_it(engines):
    dead = EngineEndpoint("dead", "http://127.0.0.1:9", None)  # discard port: refused
    with WeightSender(WeightSyncConfig(timeout_s=5)) as sender:
        with pytest.raises(WeightSyncError, match="engine dead: .*cannot connect"):
            sender.connect([engines.start("e0"), dead])
        assert sender.engines == ["e0"]
        sender.publish(_weights(1).items(), 0)
        _assert_holds(engines.engines["e0"], _weights(1), 0)


def test_bad_inputs_are_rejected_with_clear_messages(engines):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        WeightSender(WeightSyncConfig(backend="nccl"), device="cpu")
    with pytest.raises(ValueError, match="url must start with http"):
        EngineEndpoint("x", "127.0.0.1:1", None)
    with WeightSender(WeightSyncConfig()) as sender:
        sender.add_engine(engines.start("e0"))
        with pytest.raises(ValueError, match="already a weight-sync member"):
            sender.add_engine(EngineEndpoint("e0", "http://127.0.0.1:1", None))
        with pytest.raises(ValueError, match="version must be >= 0"):
            sender.publish([], -1)


class _CountingEngine(ReferenceEngine):
    """Records the tensors asked for by name; corrupts one from version 2 on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[list[str]] = []

    def route(self, method, path, body):
        if path == "/get_weights_by_name":
            self.asked[-1].append(body["name"])
        if path == "/begin_weight_update":
            self.asked.append([])
        return super().route(method, path, body)

    def update(self, body):
        reply = super().update(body)
        if int(body["weight_version"]) >= 2:
            with self._lock:
                self.tensors["layers.1.proj.weight"].view(-1)[0] += 1.0
        return reply


def test_a_groups_first_publish_checks_a_spread_and_later_ones_take_turns(engines):
    config = WeightSyncConfig(timeout_s=10, verify_tensors=3, verify_tensors_per_version=1)
    with WeightSender(config) as sender:
        sender.connect([engines.start("e0", _CountingEngine)])
        for version in range(2):
            sender.publish(_weights(version + 1).items(), version)
        with pytest.raises(WeightSyncError, match=r"tensor layers.1.proj.weight differs"):
            for version in range(2, 2 + len(_weights(0))):  # within one turn of every tensor
                sender.publish(_weights(version + 1).items(), version)
    asked = engines.engines["e0"].asked
    names = list(_weights(0))
    assert asked[0] == [names[0], names[2], names[4]]  # the first publish: a spread, ends included
    assert asked[1] == [names[0]] and asked[2] == [names[1]]  # then one a version, in turns
    # the corruption (from v2) is found at its tensor's turn: v4 compares names[3]
    assert asked[-1] == ["layers.1.proj.weight"] and len(asked) == 5
