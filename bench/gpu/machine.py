"""Stage ``machine``: what the check runs on, and the device's two ceilings measured here.

Figures: Python, torch (and its CUDA), transformers; the device's name, memory,
multiprocessors and compute capability; the bf16 dense peak from the vendor's datasheet
(``DATASHEET_BF16_DENSE``, with its source) that the learner's MFU is quoted against; and
the two ceilings METHOD.md asks for, measured on this device in this run, on random data:
a large matrix product (TFLOP/s; bf16 on CUDA, fp32 on CPU) and a large device-to-device
copy (GB/s, bytes read plus bytes written). The learner's MFU is also given against the
measured product (``bench.gpu.check.summary`` pairs them).

``timed`` is the timer every GPU stage uses: CUDA events around each call on CUDA (device
work is asynchronous), the host clock on the CPU; warm-up calls first, median after.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.gpu.stage import StageContext

# Vendor datasheet figures, dense (the datasheets' headline bf16 figures assume 2:4 sparsity
# and are twice these). H200 SXM and H100 SXM share the figure (H200.md beside the device
# tool's notes says the same); an unlisted device gets no MFU against a datasheet.
DATASHEET_BF16_DENSE: dict[str, tuple[float, str]] = {
    "H200": (989.5e12, "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 Tensor Core "
                       "1,979 TFLOPS with sparsity, 989.5 dense"),
    "H100": (989.5e12, "NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 Tensor Core "
                       "1,979 TFLOPS with sparsity, 989.5 dense"),
}  # fmt: skip
SIZES = {
    "cuda": {"matmul_n": 8192, "copy_bytes": 2 << 30, "reps": 10},
    "cpu": {"matmul_n": 384, "copy_bytes": 64 << 20, "reps": 3},
}


def datasheet_peak(device_name: str) -> tuple[float | None, str]:
    """(bf16 dense FLOP/s, source) for a device name as torch reports it, or (None, why)."""
    for key, (flops, source) in DATASHEET_BF16_DENSE.items():
        if key in device_name:
            return flops, source
    return None, f"no datasheet figure for {device_name!r}"


def timed(fn: Callable[[], Any], device: str, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    seconds = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
    return seconds


def matmul_tflops(device: str, n: int, reps: int) -> float:
    """Median TFLOP/s of an n×n×n product on random data (bf16 on CUDA, fp32 on CPU)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: torch.matmul(a, b, out=out), device, reps)
    return 2 * n**3 / statistics.median(seconds) / 1e12


def copy_gbps(device: str, nbytes: int, reps: int) -> float:
    """Median GB/s (1e9 bytes, read plus written) of one device-to-device copy of ``nbytes``."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def versions() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }


def run(ctx: StageContext) -> None:
    import torch

    sizes = SIZES[ctx.device]
    ctx.figures.update(versions())
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        peak, source = datasheet_peak(props.name)
        ctx.figures.update(
            device=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            devices=torch.cuda.device_count(),
            datasheet_bf16_dense_tflops=peak / 1e12 if peak else None,
            datasheet_source=source,
        )
    else:
        ctx.figures.update(device=platform.processor() or platform.machine(),
                           torch_threads=torch.get_num_threads())  # fmt: skip
    ctx.save()
    ctx.figures["matmul_n"] = sizes["matmul_n"]
    ctx.figures["matmul_tflops"] = matmul_tflops(ctx.device, sizes["matmul_n"], sizes["reps"])
    ctx.figures["matmul_dtype"] = "bfloat16" if ctx.cuda else "float32"
    ctx.save()
    ctx.figures["copy_bytes"] = sizes["copy_bytes"]
    ctx.figures["copy_gbps_read_plus_write"] = copy_gbps(
        ctx.device, sizes["copy_bytes"], sizes["reps"]
    )
