"""The ``/update_weights_from_tensor`` payload: tensors by shared-memory handle, decoded by
an unpickler that admits torch's rebuild functions and SGLang's bucket metadata only.

(That SGLang's own unpickler and weight updater load what ``encode_bucket`` writes is
tests/conformance/test_tensor_push.py.)
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from weight_sync.ipc_payload import (
    ALLOWED_GLOBALS,
    BucketEntry,
    PayloadError,
    decode_payload,
    encode_bucket,
    file_system_sharing,
    shared_buffer,
)


def _bucket(*tensors: tuple[str, torch.Tensor], align: int = 64):
    size = sum(-(-t.numel() * t.element_size() // align) * align for _, t in tensors)
    flat = shared_buffer(size, torch.device("cpu"))
    entries, offset = [], 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
        entries.append(BucketEntry(name, t.shape, t.dtype, offset, offset + n, n))
        offset += -(-n // align) * align
    return flat, entries


def test_a_bucket_decodes_to_views_of_the_producers_shared_memory():
    a, b = torch.randn(3, 5), torch.arange(7, dtype=torch.int64)
    half = torch.randn(4, dtype=torch.bfloat16)
    flat, entries = _bucket(("a", a), ("b", b), ("h", half))
    out = dict(decode_payload(encode_bucket(flat, entries), "flattened_bucket"))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and torch.equal(out["h"], half)
    flat.view(torch.float32)[0] = 123.0  # the decoded tensor is a handle, not a copy
    assert out["a"][0, 0].item() == 123.0


def test_cpu_buckets_must_be_shared_and_flat_uint8():
    with pytest.raises(ValueError, match="shared memory"):
        encode_bucket(torch.zeros(8, dtype=torch.uint8), [])
    with pytest.raises(ValueError, match="1-D uint8"):
        encode_bucket(torch.zeros(2, dtype=torch.float32).share_memory_(), [])


def _payload(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_a_global_outside_the_allow_list_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"

    class Gadget:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    with pytest.raises(PayloadError, match=r"global (posix|os)\.system is not admitted"):
        decode_payload(_payload(Gadget()), None)
    assert not marker.exists()
    with pytest.raises(PayloadError, match="builtins.eval"):
        decode_payload(_payload(_Reduce(eval, ("1+1",))), None)


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_file_descriptor_sharing_is_refused():
    """torch's default strategy passes a descriptor through the producer's resource sharer:
    refused (unrelated processes cannot use it, and it is a socket connection on load)."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_descriptor")
    try:
        shared = torch.zeros(4).share_memory_()
        out = io.BytesIO()
        ForkingPickler(out).dump([("x", shared)])
    finally:
        mp.set_sharing_strategy(previous)
    with pytest.raises(PayloadError, match="rebuild_storage_fd|DupFd"):
        decode_payload(base64.b64encode(out.getvalue()).decode(), None)


def test_the_allow_list_is_torchs_rebuild_functions_and_sglangs_metadata_only():
    modules = {module for module, _ in ALLOWED_GLOBALS}
    assert modules == {
        "torch",
        "torch.storage",
        "torch.multiprocessing.reductions",
        "sglang.srt.utils.patch_torch",
        "sglang.srt.weight_sync.tensor_bucket",
    }
    assert not any(name.startswith("rebuild_storage_fd") for _, name in ALLOWED_GLOBALS)


def test_a_bucket_whose_entries_overrun_it_is_refused():
    flat, entries = _bucket(("a", torch.randn(4)))
    bad = [BucketEntry("a", torch.Size([400]), torch.float32, 0, 1600, 1600)]
    with pytest.raises(PayloadError, match="do not hold"):
        decode_payload(encode_bucket(flat, bad), "flattened_bucket")
    with pytest.raises(PayloadError, match="load_format 'direct'"):
        decode_payload(encode_bucket(flat, entries), "direct")
    with pytest.raises(PayloadError, match="not base64"):
        decode_payload("%%%", "flattened_bucket")


def test_a_list_of_pairs_is_the_format_without_load_format():
    shared = torch.arange(5.0).share_memory_()
    out = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(out).dump([("w", shared)])
    ((name, tensor),) = decode_payload(base64.b64encode(out.getvalue()).decode(), None)
    assert name == "w" and torch.equal(tensor, shared)


class _CudaTensorShape:
    """Pickles as torch's reducer writes a CUDA tensor (reduce_tensor), with fake handles."""

    def __reduce__(self):
        import torch.multiprocessing.reductions as reductions

        args = (
            torch.Tensor, torch.Size([8]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
            0, b"handle", 8, 0, False, b"ref-counter", 0, b"event", True,
        )  # fmt: skip
        return reductions.rebuild_cuda_tensor, args


def test_every_global_of_a_cuda_ipc_payload_is_admitted():
    """The CUDA path needs a GPU to run; that its payload's globals are admitted does not:
    every one is let through, and the load fails only in torch's CUDA rebuild itself."""
    from weight_sync.ipc_payload import RestrictedUnpickler, _PayloadPickler

    seen: list[tuple[str, str]] = []

    class Recording(RestrictedUnpickler):
        def find_class(self, module, name):
            found = super().find_class(module, name)  # PayloadError if not admitted
            seen.append((module, name))
            return found

    out = io.BytesIO()
    entries = [BucketEntry("w", torch.Size([2]), torch.float32, 0, 8, 8)]
    _PayloadPickler(out).dump({"flattened_tensor": _CudaTensorShape(), "metadata": entries})
    with pytest.raises(RuntimeError):  # no CUDA device here (or a fake handle on one)
        Recording(io.BytesIO(out.getvalue())).load()
    assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in seen
    assert ("torch.storage", "TypedStorage") in seen


def test_a_cuda_device_named_by_a_uuid_this_process_lacks_is_refused():
    from weight_sync.ipc_payload import _rebuild_cuda_tensor_by_uuid

    args = list(_CudaTensorShape().__reduce__()[1])
    args[6] = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(PayloadError, match="which this process does not see"):
        _rebuild_cuda_tensor_by_uuid(*args)


def _shared_segment(nbytes: int):
    """(storage, manager, handle) of a fresh shared-memory segment, as a producer shares it."""
    with file_system_sharing():
        storage = torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()
        manager, handle, size = storage._share_filename_cpu_()
    assert size == nbytes
    return storage, manager, handle


def test_a_segment_smaller_than_its_claimed_storage_is_refused_before_mapping():
    """A payload claiming more bytes than the /dev/shm segment holds: torch would grow the
    segment (another process's memory) to the claim and read zeros as weights."""
    from torch.multiprocessing import reductions

    keep, manager, handle = _shared_segment(64)
    segment = "/dev/shm/" + handle.decode().lstrip("/")
    before = os.stat(segment).st_size
    lying = _Reduce(reductions.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, 1 << 30))  # fmt: skip
    with pytest.raises(PayloadError, match=r"claims 1073741824 bytes of shared memory .* holds 64"):
        decode_payload(_payload([("w", _Reduce(reductions.rebuild_tensor, (torch.Tensor, lying, (0, (4,), (1,), False))))]), None)  # fmt: skip
    assert os.stat(segment).st_size == before  # never grown
    for bad in (b"/../../etc/passwd", b"/nothing_here_at_all"):
        args = (torch.UntypedStorage, manager, bad, 8)
        with pytest.raises(PayloadError, match="shared memory"):
            decode_payload(_payload([("w", _Reduce(reductions.rebuild_tensor, (torch.Tensor, _Reduce(reductions.rebuild_storage_filename, args), (0, (4,), (1,), False))))]), None)  # fmt: skip
    del keep


def test_a_tensor_reaching_past_its_shared_storage_is_refused():
    """torch would crash the engine (SIGSEGV) setting such a tensor on mapped memory."""
    from torch.multiprocessing import reductions

    def tensor(layout):  # a segment of 16 bytes each time: a decode drops its reference
        keep, manager, handle = _shared_segment(16)
        storage = _Reduce(reductions.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, 16))  # fmt: skip
        typed = _Reduce(
            reductions.rebuild_typed_storage, (storage, torch.uint8)
        )  # as torch writes it
        return keep, _Reduce(reductions.rebuild_tensor, (torch.Tensor, typed, layout))

    for layout in ((0, (64,), (1,), False), (8, (9,), (1,), False), (0, (2, 3), (16, 1), False)):
        _keep, payload = tensor(layout)
        with pytest.raises(PayloadError, match="reaches past its 16-byte storage"):
            decode_payload(_payload([("w", payload)]), None)
    _keep, fits = tensor((8, (8,), (1,), False))
    ((_, decoded),) = decode_payload(_payload([("w", fits)]), None)
    assert decoded.numel() == 8
