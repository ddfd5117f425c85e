"""Weights between two processes on one device without a collective: CUDA IPC, against a copy.

The co-located mode's ceiling. A producer (this process) holds a flat buffer on the
device and hands a second process an IPC handle to it; that process opens the handle
(``cudaIpcOpenMemHandle`` under torch's ``UntypedStorage._new_shared_cuda``, as
``torch.multiprocessing`` does) and copies the buffer into memory of its own, as an engine
loading weights from a handle does. The plain copy of the same bytes inside one process is
the baseline. On CPU the same protocol runs over a shared-memory file
(``_share_filename_cpu_``), so that every line but the two handle calls runs in the CPU check.

The handle travels as JSON over the child's stdin (bytes in base64): no pickle on a wire
of ours. The child answers each ``copy`` with the seconds it took (CUDA events) and a
checksum of strided bytes of its copy, which the producer checks against its own buffer
(random bytes: a copy that read the wrong memory, or none, fails).

    python -m bench.gpu.ipc --consumer    # the child's side (JSON lines on stdin/stdout)

Left out: the engine side of a real co-located update (``/update_weights_from_tensor``
through SGLang's serializer, the co-located mode's own path: ``bench.gpu.weight_sync``
calls it when it is wired in).
"""

from __future__ import annotations

import base64
import functools
import json
import statistics
import subprocess
import sys
import time
from typing import Any

CHECK_STRIDE = 4099  # bytes between checksummed positions (a prime: no alignment pattern)


def _b64(value: Any) -> Any:
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _unb64(value: Any) -> Any:
    return base64.b64decode(value["b64"]) if isinstance(value, dict) and "b64" in value else value


def export_handle(buffer: Any) -> dict[str, Any]:
    """A JSON-safe handle to ``buffer``'s storage (CUDA IPC, or a shared-memory file on CPU)."""
    storage = buffer.untyped_storage()
    if buffer.is_cuda:
        return {"kind": "cuda", "fields": [_b64(f) for f in storage._share_cuda_()]}
    buffer.share_memory_()
    fields = buffer.untyped_storage()._share_filename_cpu_()
    return {"kind": "cpu", "fields": [_b64(f) for f in fields]}


def open_handle(handle: dict[str, Any]) -> Any:
    """The producer's buffer, as a uint8 tensor of this process (no copy made)."""
    import torch

    fields = [_unb64(f) for f in handle["fields"]]
    if handle["kind"] == "cuda":
        torch.cuda.init()  # as torch.multiprocessing's rebuild_cuda_tensor does first
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
    else:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*fields)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def checksum(buffer: Any) -> int:
    import torch

    return int(buffer[::CHECK_STRIDE].to(dtype=torch.int64).sum().item())


def _consumer() -> int:
    """The child: open the handle, then answer ``copy`` requests until ``bye``."""
    import torch

    from bench.gpu.machine import timed

    request = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    source = open_handle(request["handle"])
    device = "cuda" if source.is_cuda else "cpu"
    if device == "cuda":
        torch.cuda.set_device(source.device)
    own = torch.empty_like(source)
    _reply({"opened_s": time.perf_counter() - t0, "bytes": source.numel()})
    for line in sys.stdin:
        message = json.loads(line)
        if message["op"] != "copy":
            break
        seconds = timed(functools.partial(own.copy_, source), device, message["reps"], warmup=1)
        _reply({"seconds": seconds, "checksum": checksum(own)})
    source = None  # closes the IPC mapping before the producer frees the buffer
    return 0


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def measure(device: str, nbytes: int, reps: int) -> dict[str, Any]:
    """GB/s (1e9 bytes copied per second, each byte counted once) of the copy through an IPC
    handle in a second process, and of a plain copy in this one; the handle's open time."""
    import torch

    from bench.gpu.machine import timed

    gen = torch.Generator(device="cpu").manual_seed(0)
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
    local = torch.empty_like(buffer)
    local_s = timed(lambda: local.copy_(buffer), device, reps)
    expected = checksum(buffer)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu.ipc", "--consumer"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps({"handle": export_handle(buffer)}) + "\n")
        child.stdin.flush()
        opened = _read(child)
        child.stdin.write(json.dumps({"op": "copy", "reps": reps}) + "\n")
        child.stdin.flush()
        copied = _read(child)
        child.stdin.write(json.dumps({"op": "bye"}) + "\n")
        child.stdin.flush()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()  # our own child, by its handle
            child.wait()
    if copied["checksum"] != expected:
        raise RuntimeError(
            f"the copy through the IPC handle differs from the buffer (checksum "
            f"{copied['checksum']} != {expected})"
        )
    ipc_gbps = nbytes / statistics.median(copied["seconds"]) / 1e9
    local_gbps = nbytes / statistics.median(local_s) / 1e9
    return {
        "transport": "cuda_ipc" if device == "cuda" else "shared_memory_file (CPU stand-in)",
        "bytes": nbytes,
        "handle_open_s": opened["opened_s"],
        "ipc_copy_gbps": ipc_gbps,
        "local_copy_gbps": local_gbps,
        "ipc_vs_local_copy": ipc_gbps / local_gbps,
        "checksum_matches": True,
    }


def _read(child: subprocess.Popen) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the IPC consumer exited with status {child.wait()}")
    return json.loads(line)


if __name__ == "__main__":
    if sys.argv[1:] == ["--consumer"]:
        sys.exit(_consumer())
    sys.exit("usage: python -m bench.gpu.ipc --consumer (the child side of bench.gpu.ipc.measure)")
