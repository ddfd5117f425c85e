"""Stage ``weight_sync``: weights between two processes on the one device, against a copy.

One GPU rules out NCCL between the learner and an engine (it refuses two ranks on one
device), so the paths measured are the ones a one-GPU or co-located run can take:

- ``gloo_*``: fleetrl's ``WeightSender`` publishing to a receiver process
  (``weight_sync.reference_engine``) over a gloo group, CUDA tensors staged through host
  memory by gloo, in ``bench.weight_sync.measure_size``'s three variants alternated:
  bucketed (``flattened_bucket``, 512 MiB buckets on CUDA), one raw broadcast of the same
  bytes, one broadcast per parameter;
- ``ipc_*``: the same bytes through a CUDA IPC handle into a second process
  (``bench.gpu.ipc``), and ``local_copy_gbps``, a plain copy in one process: the baseline
  every path is divided by;
- ``colocated_*``: the co-located mode's push (``/update_weights_from_tensor`` through
  SGLang's serializer; docs/colocation.md) at this stage's size, when
  ``--colocated-push MODULE:FUNCTION`` names it: a ``ColocatedPush`` called with the same
  tensors. Without one the figure says it is not wired in here and points to the
  ``colocated`` stage (``bench.gpu.colocated``), which measures that push
  (``weight_sync.tensor_push`` into an embedded engine, ``push_gbps``) at its own small
  model: a default here would need an engine holding a model of these tensors' names and
  shapes, written out and loaded, which this stage's time, most of it gloo's, lacks.

The tensors are a decoder's parameter list (``bench.weight_sync.transformer_param_shapes``:
CUDA hidden 1024, 16 layers, vocabulary 32,000, bf16: about 0.5 GB). GB/s are 1e9 bytes
of weights delivered per second, each byte counted once.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.gpu.stage import CheckFailed, StageContext

SIZES = {
    "cuda": {"hidden": 1024, "layers": 16, "vocab": 32000, "reps": 5, "ipc_reps": 20,
             "bucket_mb": 512.0},
    "cpu": {"hidden": 64, "layers": 2, "vocab": 512, "reps": 2, "ipc_reps": 3,
            "bucket_mb": 128.0},
}  # fmt: skip
# The co-located mode's push: (named tensors on the device, device, a scratch folder) ->
# figures, at least {"seconds": one version's push, end to end}.
ColocatedPush = Callable[[Sequence[tuple[str, Any]], str, Path], dict[str, float]]
# the ``colocated`` figure without --colocated-push (the module docstring says why)
NOT_WIRED_IN = (
    "not wired in here: the colocated stage measures the co-located push "
    "(push_gbps); --colocated-push MODULE:FUNCTION measures it at this size"
)


def load_colocated_push(spec: str) -> ColocatedPush:
    """``MODULE:FUNCTION`` -> the function (a clear error naming what is missing)."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise CheckFailed(f"--colocated-push {spec!r}: expected MODULE:FUNCTION")
    function = getattr(importlib.import_module(module_name), function_name, None)
    if not callable(function):
        raise CheckFailed(f"--colocated-push {spec!r}: {module_name} has no {function_name}()")
    return function


def _colocated(ctx: StageContext, shapes: list, dtype: Any, total_bytes: int) -> dict[str, Any]:
    spec = ctx.options.get("colocated_push")
    if not spec:
        return {"colocated": NOT_WIRED_IN}
    import torch

    push = load_colocated_push(spec)
    gen = torch.Generator().manual_seed(1)
    tensors = [(n, torch.randn(s, generator=gen).to(dtype).to(ctx.device)) for n, s in shapes]
    figures = push(tensors, ctx.device, ctx.work / "colocated")
    seconds = float(figures["seconds"])
    return {"colocated": spec, "colocated_gbps": total_bytes / seconds / 1e9,
            **{f"colocated_{k}": v for k, v in figures.items()}}  # fmt: skip


def run(ctx: StageContext) -> None:
    import torch

    from bench.common import Progress, ratio
    from bench.gpu import ipc
    from bench.weight_sync import measure_size, transformer_param_shapes

    sizes = SIZES[ctx.device]
    ctx.figures["sizes"] = sizes
    t0 = time.monotonic()
    ipc_figures = ipc.measure(ctx.device, _bytes(sizes, ctx.cuda), sizes["ipc_reps"])
    ctx.figures.update(ipc_figures, ipc_s=round(time.monotonic() - t0, 1))
    ctx.save()
    gloo = measure_size(
        sizes["hidden"], sizes["layers"], sizes["vocab"], sizes["reps"], ctx.device,
        sizes["bucket_mb"], Progress("gpu-check weight_sync"), backend="gloo",
        deadline=ctx.deadline - 0.25 * ctx.seconds_left(),
    )  # fmt: skip
    copy = ipc_figures["local_copy_gbps"]
    for variant, stats in gloo["gbps"].items():
        ctx.figures[f"gloo_{variant}_gbps"] = stats["median"]
        ctx.figures[f"gloo_{variant}_vs_local_copy"] = ratio(stats["median"], copy)
    ctx.figures.update(
        gloo_bucketed_vs_raw_broadcast=ratio(
            gloo["gbps"]["bucketed"]["median"], gloo["gbps"]["raw_broadcast"]["median"]
        ),
        gloo_reps=len(gloo["gbps"]["bucketed"]["reps"]),
        dtype=gloo["dtype"],
    )
    ctx.save()
    shapes = transformer_param_shapes(sizes["hidden"], sizes["layers"], sizes["vocab"])
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    ctx.figures.update(_colocated(ctx, shapes, dtype, gloo["bytes"]))
    if gloo["bytes"] != ipc_figures["bytes"]:
        raise CheckFailed(f"the gloo and IPC paths moved different bytes: {gloo['bytes']} vs "
                          f"{ipc_figures['bytes']}")  # fmt: skip


def _bytes(sizes: dict[str, Any], cuda: bool) -> int:
    """Bytes of the decoder's parameters in the stage's dtype (bf16 on CUDA, fp32 on CPU)."""
    from bench.weight_sync import transformer_param_shapes

    shapes = transformer_param_shapes(sizes["hidden"], sizes["layers"], sizes["vocab"])
    return sum(math.prod(shape) for _, shape in shapes) * (2 if cuda else 4)
