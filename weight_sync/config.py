"""Weight-sync section of the run config (used by ``weight_sync.sender.WeightSender``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class WeightSyncConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        Meta(description="Collective backend: auto = nccl with CUDA, else gloo."),
    ] = "auto"
    bucket_mb: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(
            description="Flat bucket size in MiB (peers use 512-1024 on GPU). Unset: per backend (DEFAULT_BUCKET_MB): gloo 128, because on CPU each bucket costs an HTTP round trip and an engine-side load that the next broadcast waits for, and gloo's per-call cost is high, so fewer, larger buckets win; nccl 64."
        ),
    ] = None
    pause_mode: Annotated[
        Literal["in_place", "abort", "retract"],
        Meta(
            description="How engines pause for an update: keep KV and continue (in_place), abort and resubmit partials (abort), or recompute KV later (retract)."
        ),
    ] = "in_place"
    sync_every: Annotated[
        int, Meta(ge=1, description="Publish a new policy version every this many learner steps.")
    ] = 1
    timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A broadcast to an engine taking longer fails with the engine's name; the run continues with the others.",
        ),
    ] = 60.0
    verify: Annotated[
        bool,
        Meta(
            description="After each publish, check through SGLang's own routes that every engine serves the version (GET /model_info) and holds the values sent (POST /get_weights_by_name, verify_rows rows of each compared tensor: verify_tensors of them on a weight group's first publish, verify_tensors_per_version after it); a mismatch is an error naming the engine. An engine that cannot report weights by name (SGLang answers it for some architectures only) has its values left unchecked, said once in the log."
        ),
    ] = True
    verify_tensors: Annotated[
        int,
        Meta(
            ge=1,
            description="How many tensors the first publish to a weight group (a new or changed membership, where a rendezvous or layout error would show) compares per engine, spread evenly over the stream (the first and the last always).",
        ),
    ] = 8
    verify_tensors_per_version: Annotated[
        int,
        Meta(
            ge=0,
            description="How many tensors every later publish to the same group compares per engine, taking turns through the stream so that each is compared every (tensors ÷ this) versions; 0 = the served version only. Each is one HTTP request per engine per version: at small sizes they were a third of a publish.",
        ),
    ] = 1
    verify_rows: Annotated[
        int,
        Meta(
            ge=1,
            description="Leading rows (or elements of a 1-D tensor) compared per verified tensor.",
        ),
    ] = 2
    load_format: Annotated[
        Literal["flattened_bucket", "per_tensor"],
        Meta(
            description="Wire format of an update: flattened_bucket = one broadcast per bucket of bucket_mb (fast); on CPU (gloo), tensors of 1 MiB and more (ZERO_COPY_MB) are sent uncopied in per-tensor requests beside the buckets, since there a packing copy costs more than the broadcasts it saves; per_tensor = one broadcast per tensor, SGLang's default format, for engines without flattened_bucket support."
        ),
    ] = "flattened_bucket"
    group_name: Annotated[str, Meta(description="Name of the weight-update process group.")] = (
        "fleetrl_weights"
    )
    adapter_dir: Annotated[
        str,
        Meta(
            description="With learner.lora.rank > 0: the folder learner rank 0 writes each version's LoRA adapter to and every engine loads it from by path (SGLang's /load_lora_adapter); empty = <trainer.output_dir>/adapters. On a cluster it must be storage the engines' nodes read at the same path."
        ),
    ] = ""


# Bucket size when ``bucket_mb`` is unset, per collective backend. gloo (CPU): every bucket
# is one HTTP request whose engine-side load the next broadcast waits for, and gloo's
# per-call cost is high, so fewer, larger buckets win: on the 84 MB quick bench model, in
# one profiling run of 9 alternated publishes each (buffers reused), 16 MiB buckets ran at
# 0.86x one broadcast per parameter, 64 MiB at 0.95x, 128 MiB at 1.08x (one bucket).
# Since then the CPU buckets hold only tensors under ZERO_COPY_MB; the size still bounds
# each per-tensor request of the larger ones (one request for all 30 of the quick model).
# nccl: unchanged (64 MiB).
DEFAULT_BUCKET_MB = {"gloo": 128.0, "nccl": 64.0}


def bucket_mb_for(config: WeightSyncConfig, backend: str) -> float:
    """``config.bucket_mb``, or the backend's default (``DEFAULT_BUCKET_MB``) when unset."""
    if config.bucket_mb is not None:
        return config.bucket_mb
    if backend not in DEFAULT_BUCKET_MB:
        raise ValueError(
            f"weight_sync.backend: no default bucket size for {backend!r}; "
            f"set weight_sync.bucket_mb (known: {sorted(DEFAULT_BUCKET_MB)})"
        )
    return DEFAULT_BUCKET_MB[backend]


# flattened_bucket: tensors of at least this many MiB go uncopied in SGLang's per-tensor
# format (one broadcast each) instead of being packed, keyed by the broadcast device's type;
# a type not listed packs everything. CPU (gloo): packing is a pass over host memory,
# dearer than the broadcasts it saves (see ``weight_sync.buckets``). CUDA (nccl, or gloo
# on a GPU in tests): the pack is a device copy, far cheaper than a broadcast call, so
# everything is packed, as before.
ZERO_COPY_MB: dict[str, float] = {"cpu": 1.0}


def zero_copy_bytes_for(config: WeightSyncConfig, device_type: str) -> int | None:
    """Tensors of at least this many bytes are sent uncopied, one broadcast each (None: none).

    per_tensor sends every tensor so (0); flattened_bucket per ``ZERO_COPY_MB``.
    """
    if config.load_format == "per_tensor":
        return 0
    threshold_mb = ZERO_COPY_MB.get(device_type)
    return None if threshold_mb is None else int(threshold_mb * 2**20)
