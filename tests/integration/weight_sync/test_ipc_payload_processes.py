"""The tensor payload between processes: what an unrelated process reads by handle, and the
one encoding per reader that torch's shared-memory reference count needs."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.unit.weight_sync.test_ipc_payload import _bucket
from weight_sync.ipc_payload import encode_bucket


def test_another_process_maps_the_bucket_by_name():
    """The handle is a /dev/shm file name: an unrelated process (not a fork) reads it."""
    a = torch.randn(16)
    flat, entries = _bucket(("a", a))
    code = (
        "import sys, torch\n"
        "from weight_sync.ipc_payload import decode_payload\n"
        "(name, t), = decode_payload(sys.stdin.read(), 'flattened_bucket')\n"
        "print(name, repr(t.sum().item()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=encode_bucket(flat, entries),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    name, total = done.stdout.split()
    assert name == "a" and float(total) == a.sum().item()


def test_each_consumer_needs_its_own_encoding_of_a_bucket():
    """torch counts a reference per pickling, dropped by the process that unpickles it: two
    long-lived readers of one encoding unlink the memory under the producer; one encoding
    per reader (what TensorSender sends each TP rank) keeps it for every round."""
    a = torch.full((16,), 2.0)
    flat, entries = _bucket(("a", a))
    code = (
        "import sys\n"
        "from weight_sync.ipc_payload import decode_payload\n"
        "for line in sys.stdin:\n"
        "    try:\n"
        "        ((_, t),) = decode_payload(line.strip(), 'flattened_bucket')\n"
        "        print(t.sum().item(), flush=True)\n"
        "        del t\n"
        "    except Exception as err:\n"
        "        print('failed', type(err).__name__, flush=True)\n"
    )

    def rounds(shared_encoding: bool) -> list[str]:
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        one = encode_bucket(flat, entries)
        out = []
        for _ in range(2):
            for reader in readers:
                reader.stdin.write(
                    (one if shared_encoding else encode_bucket(flat, entries)) + "\n"
                )
                reader.stdin.flush()
                out.append(reader.stdout.readline().strip())
        for reader in readers:
            reader.stdin.close()
            reader.wait(60)
        return out

    assert rounds(shared_encoding=False) == ["32.0"] * 4
    assert "failed PayloadError" in rounds(shared_encoding=True)[2:]
