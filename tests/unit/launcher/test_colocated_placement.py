"""Co-located placement and the merge of the ranks' publish results.

Engine i shares bundle i of the learner's placement group with learner rank i: the
bundle holds both their CPUs and the rank's GPU, which each reserves half of in Ray's
accounting; the preflight places no engines on rollout nodes. A publish in which every
rank pushed to its own engine merges into one outcome.
"""

from __future__ import annotations

from launcher.config import load_run_config
from launcher.placement import bundle_options, colocated_engine_options, learner_bundle
from launcher.preflight_findings import Node
from launcher.preflight_resources import check_resources
from launcher.results import PublishResult, merge_publish_results
from rollout_fleet.membership import EngineTarget, SyncOutcome

GPU_RUN = [
    "rollout.placement=colocated",
    "trainer.device=cuda",
    "learner.num_ranks=4",
    "learner.gpus_per_rank=1",
    "learner.cpus_per_rank=2",
    "rollout.num_engines=4",
    "rollout.cpus_per_engine=1",
]


def test_a_bundle_holds_the_rank_and_its_engine_who_each_reserve_half_its_gpu():
    cfg = load_run_config(None, GPU_RUN)
    assert learner_bundle(cfg) == {"CPU": 3.0, "learner": 1.0, "GPU": 1}
    rank = bundle_options(object(), 2, cfg)
    engine = colocated_engine_options(cfg, object(), 2)
    assert (rank["num_cpus"], rank["num_gpus"]) == (2, 0.5)
    assert (engine["num_cpus"], engine["num_gpus"]) == (1, 0.5)
    assert engine["scheduling_strategy"].placement_group_bundle_index == 2
    disaggregated = load_run_config(None, [o for o in GPU_RUN if "placement" not in o])
    assert learner_bundle(disaggregated)["CPU"] == 2
    assert bundle_options(object(), 0, disaggregated)["num_gpus"] == 1


def test_preflight_places_co_located_engines_in_the_learner_bundles_only():
    cfg = load_run_config(None, GPU_RUN)
    learner_node = Node("gpu-node", {"CPU": 12.0, "GPU": 4.0, "learner": 1000.0})  # no rollout
    assert check_resources(cfg, [learner_node], local=False) == []
    small = Node("gpu-node", {"CPU": 11.0, "GPU": 4.0, "learner": 1000.0})
    (finding,) = check_resources(cfg, [small], local=False)
    assert finding.key == "learner.cpus_per_rank" and "CPU 3" in finding.problem


def _target(name: str, rank: int) -> EngineTarget:
    return EngineTarget(name=name, url=f"http://{name}", incarnation=1, device_rank=rank)


def test_the_ranks_results_merge_into_one_outcome():
    rank0 = PublishResult(
        version=3,
        outcome=SyncOutcome(version=3, targets=(_target("engine-0", 0),)),
        seconds=0.5,
        metrics={"colocate/push_s": 0.5, "colocate/push_bytes": 100.0, "weight_sync/seconds": 0.5},
    )
    rank1 = PublishResult(
        version=3,
        outcome=SyncOutcome(
            version=3, targets=(_target("engine-1", 1),), failed={"engine-1": "timed out"}
        ),
        seconds=0.9,
        metrics={"colocate/push_s": 0.9, "colocate/push_bytes": 100.0},
    )
    merged = merge_publish_results([rank0, rank1])
    assert [t.name for t in merged.outcome.targets] == ["engine-0", "engine-1"]
    assert merged.failed_engines == ("engine-1",) and not merged.needs_resend
    assert merged.metrics["colocate/push_s"] == 0.9  # the slowest rank
    assert merged.metrics["colocate/push_bytes"] == 200.0
    assert merged.seconds == 0.9
    plain = PublishResult(version=3)  # a disaggregated run's other ranks: rank 0's result
    assert merge_publish_results([rank0, plain, plain]) is rank0


def test_a_mixed_run_places_its_remote_engines_on_rollout_nodes_with_their_own_specs():
    from rollout_fleet.actors import engine_spec

    cfg = load_run_config(
        None,
        [
            *[o for o in GPU_RUN if not o.startswith("rollout.num_engines")],
            "rollout.num_engines=6",
            "rollout.colocate.remote_engines=2",
            "rollout.gpus_per_engine=1",
        ],
    )
    assert cfg.rollout.colocated_engines == 4
    assert [cfg.rollout.is_colocated_slot(i) for i in range(6)] == [True] * 4 + [False] * 2
    learners = Node("gpu-node", {"CPU": 12.0, "GPU": 4.0, "learner": 1000.0})
    (short,) = check_resources(cfg, [learners], local=False)  # the 2 remote engines
    assert short.key == "ray.rollout_resource"
    rollout = Node("rollout-node", {"CPU": 2.0, "GPU": 2.0, "rollout": 1000.0})
    assert check_resources(cfg, [learners, rollout], local=False) == []
    colocated = engine_spec(cfg.rollout, "engine-0", "/m", colocated=True, pause_mode="in_place")
    remote = engine_spec(cfg.rollout, "engine-4", "/m", colocated=False, pause_mode="in_place")
    assert colocated.memory_saver and not colocated.disable_radix_cache  # retract: flushed
    assert not remote.memory_saver and remote.disable_radix_cache  # in_place updates
