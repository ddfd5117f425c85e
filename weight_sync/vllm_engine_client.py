"""The weight-sync calls to one vLLM 0.34 engine: ``EngineClient``'s methods on vLLM's routes.

The order of one version (vLLM's own, as its ``NCCLTrainerWeightTransferEngine`` drives
it; the conformance tier drives this client against vLLM's router):

    GET  /get_world_size                   the engine's ranks (TP) must be what fleetrl placed
    POST /init_weight_transfer_engine      {init_info: {master_address, master_port,
                                            rank_offset, world_size, packed: true,
                                            packed_buffer_size_bytes, packed_num_buffers}}
                                           blocks until the learner joins as rank 0
                                           (weight_sync.vllm_group), once per group
    POST /pause?mode=keep|abort            per version (rollout_fleet.vllm_client.PAUSE_MODES)
    POST /start_weight_update
    POST /update_weights                   {update_info: {names, dtype_names, shapes}} beside
                                           the broadcast of that bucket, per bucket
    POST /finish_weight_update             {weight_version}
    POST /reset_prefix_cache               unless the pause kept requests running
    POST /resume
    GET  /weight_info                      the version, read back by verification

A bucket is one vLLM packed chunk: ``packed_buffer_size_bytes`` is the sender's bucket
size, and vLLM's consumer cuts a request's tensors into chunks of at most that many bytes
in request order, so every request the sender makes (at most one bucket) is one
broadcast. ``/shutdown_weight_transfer_engine`` leaves the group.

LoRA: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` ({lora_name, lora_path},
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set by the launcher), then
``/update_weight_version``. Not offered by vLLM here: reading tensors back by name
(``weights_by_name`` answers None, so verification checks the version only), loading a
checkpoint folder in place, and pushes by handle (vLLM's IPC transfer is a launch-time
backend of its own).
"""

from __future__ import annotations

from typing import Any

from weight_sync.engine_client import EngineCallError, EngineClient, GroupJoin

PAUSE_MODES = {"in_place": "keep", "abort": "abort", "retract": "abort"}
PACKED_NUM_BUFFERS = 2


class VllmWeightClient(EngineClient):
    """The weight-sync client of one vLLM engine (see the module docstring)."""

    takes_per_tensor_broadcasts = False
    weight_version_route = "/weight_info"

    def init_group(self, join: GroupJoin) -> dict[str, Any]:
        ranks = self.call("/get_world_size", method="GET").get("world_size")
        if ranks != self.endpoint.world_size:
            raise EngineCallError(
                self.name,
                "/get_world_size",
                f"the engine has {ranks} ranks but fleetrl placed it with {self.endpoint.world_size}",
                unreachable=False,
            )
        init_info = {
            "master_address": join.master_address,
            "master_port": int(join.master_port),
            "rank_offset": join.rank_offset,
            "world_size": join.world_size,
            "packed": True,
            "packed_buffer_size_bytes": max(1, int(join.bucket_bytes)),
            "packed_num_buffers": PACKED_NUM_BUFFERS,
        }
        return self.call("/init_weight_transfer_engine", {"init_info": init_info})

    def begin_update(self) -> dict[str, Any]:
        return self.call("/start_weight_update", None)

    def update_weights(self, wire_fields: dict[str, list], **_sglang_fields: Any) -> dict[str, Any]:
        """One bucket's metadata; vLLM takes no group name, version or load format here (the
        version comes with ``end_update``)."""
        update_info = {
            "names": wire_fields["names"],
            "dtype_names": wire_fields["dtypes"],
            "shapes": wire_fields["shapes"],
        }
        return self.call("/update_weights", {"update_info": update_info})

    def end_update(self, weight_version: str | None = None) -> dict[str, Any]:
        return self.call("/finish_weight_update", {"weight_version": weight_version})

    @staticmethod
    def weight_group(store: Any, **options: Any) -> Any:
        from weight_sync.vllm_group import VllmWeightGroup

        return VllmWeightGroup(store, **options)

    def flush_cache(self) -> dict[str, Any]:
        return self.call("/reset_prefix_cache", None)

    def destroy_group(self, group_name: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("/shutdown_weight_transfer_engine", None, timeout_s=timeout_s)

    def pause(self, mode: str) -> dict[str, Any]:
        return self.call(f"/pause?mode={PAUSE_MODES[mode]}", None)

    def resume(self) -> dict[str, Any]:
        return self.call("/resume", None)

    def set_weight_version(self, version: str) -> dict[str, Any]:
        return self.call("/update_weight_version", {"new_version": version})

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        return self.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return self.call("/v1/unload_lora_adapter", {"lora_name": name})

    def weights_by_name(self, name: str, rows: int) -> list | None:
        return None  # vLLM has no route that reads a tensor back

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise EngineCallError(
            self.name,
            "/update_weights_from_tensor",
            "vLLM engines take weights by broadcast here (its IPC transfer is not offered)",
            unreachable=False,
        )

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise EngineCallError(
            self.name,
            "/update_weights_from_disk",
            "vLLM engines take weights by broadcast (no in-place load from a folder)",
            unreachable=False,
        )
