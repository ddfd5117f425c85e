"""Stage ``colocated``: one co-located switch on the device, learner and engine in two processes.

Runs ``bench.colocated_check.check_colocated(work, figures, device)``: an embedded engine
with the memory saver in a process of its own (a ~17 M-parameter model), paused and
released; the device memory that came back; its weights resumed and version 1 pushed by
handle through ``/update_weights_from_tensor`` (``weight_sync.tensor_push``: CUDA IPC on
a GPU, a shared-memory file on CPU; rows checked through ``/get_weights_by_name``); its KV
cache resumed and a ``/generate`` answered on version 1; then an FSDP2 learner (one rank)
offloaded and onloaded (``learner.offload``) with its forward unchanged.

Figures: ``check_colocated``'s, plus the headline ones this module derives
(``headline_figures``): ``bytes_released`` (what the engine reported its released tags
held), ``memory_returned`` (the release gave back at least 80 % of the pushed bytes:
on CUDA device memory seen by ``torch.cuda.mem_get_info`` in this process, on CPU the
engine's RSS), ``ipc_ok`` (the push by handle loaded, verified and was served),
``transport``, and ``switch_s``: what one co-located step pays to hand the device over
and back (release + offload + onload + resume weights + push + resume KV cache). It fails
with every check that did not hold (``bench.colocated_check.problems``), one line.

Left out: a real SGLang server's ``torch_memory_saver`` (CUDA virtual memory; it needs
SGLang's kernels, which the GPU check's machine lacks) and sizes of a real model: the
switch's seconds here are for a small model, its bytes are what the check proves.
"""

from __future__ import annotations

import time
from typing import Any

from bench.gpu.stage import CheckFailed, StageContext

# the parts of one co-located switch, in the order a step pays them (colocate/* metrics)
SWITCH_PARTS = ("release_s", "offload_s", "onload_s", "resume_weights_s", "push_s",
                "resume_kv_s")  # fmt: skip


def headline_figures(figures: dict[str, Any], device: str) -> dict[str, Any]:
    """The derived figures (module docstring) from ``check_colocated``'s, as far as it got."""
    out: dict[str, Any] = {
        "transport": "cuda_ipc" if device == "cuda" else "shared_memory_file (CPU stand-in)"
    }
    if "bytes_reported" in figures:
        out["bytes_released"] = figures["bytes_reported"]
    freed, pushed = figures.get("device_bytes_freed"), figures.get("push_bytes")
    if freed is not None and pushed:
        out["memory_returned"] = freed >= 0.8 * pushed
    if "push_bytes" in figures:
        out["ipc_ok"] = figures.get("served_version") == "1" and figures["push_bytes"] > 0
    if all(figures.get(part) is not None for part in SWITCH_PARTS):
        out["switch_s"] = sum(float(figures[part]) for part in SWITCH_PARTS)
    return out


def run(ctx: StageContext) -> None:
    from bench.colocated_check import check_colocated, problems

    started = time.monotonic()
    try:
        check_colocated(ctx.work, ctx.figures, device=ctx.device)
    finally:  # what was measured, also when the cycle raised or the stage was stopped
        ctx.figures.update(headline_figures(ctx.figures, ctx.device))
        ctx.figures["wall_s"] = round(time.monotonic() - started, 1)
    failed = problems(ctx.figures, ctx.device)
    if failed:
        raise CheckFailed("; ".join(failed))
