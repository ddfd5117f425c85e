"""Every message that crosses a process boundary between rollout_fleet, buffer and learner.

Wire choices (DESIGN §4), in one place so producers and consumers cannot drift:
- msgspec Structs encoded as msgpack with ``array_like=True``: a struct is a
  positional array, so field names are not repeated per message. New fields are
  only ever *appended* with defaults; fields are never reordered or removed.
- Every top-level message carries ``schema`` (``SCHEMA_VERSION``); a receiver
  refuses other versions instead of misreading them.
- Token ids, logprobs and versions travel as ``Array``: a dtype string plus the
  raw little-endian bytes, never as Python lists (a list of 4k ints costs ~40x
  more to encode and decode than its bytes).
- Encoders/decoders are built once and reused (``ENCODER``, ``decoder(T)``).
- Never pickle: nothing here can execute code when decoded.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # receivers set ZMQ_MAXMSGSIZE to this by default

_DTYPES = {"int32": "<i4", "int64": "<i8", "float32": "<f4", "float16": "<f2", "uint8": "u1"}


class WireError(ValueError):
    """A message that cannot be accepted (malformed, wrong schema, inconsistent lengths)."""


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A 1-D numeric array as raw little-endian bytes plus its dtype name."""

    dtype: str
    data: bytes

    @classmethod
    def of(cls, values: Any, dtype: str) -> Array:
        if dtype not in _DTYPES:
            raise WireError(f"unsupported wire dtype {dtype!r}; accepted: {sorted(_DTYPES)}")
        arr = np.ascontiguousarray(np.asarray(values), dtype=_DTYPES[dtype]).reshape(-1)
        return cls(dtype, arr.tobytes())

    def numpy(self) -> np.ndarray:
        if self.dtype not in _DTYPES:
            raise WireError(f"unsupported wire dtype {self.dtype!r}")
        np_dtype = np.dtype(_DTYPES[self.dtype])
        if len(self.data) % np_dtype.itemsize:
            raise WireError(f"{len(self.data)} bytes is not a whole number of {self.dtype}")
        return np.frombuffer(self.data, dtype=np_dtype)

    def __len__(self) -> int:
        return len(self.data) // np.dtype(_DTYPES.get(self.dtype, "u1")).itemsize


class Trajectory(msgspec.Struct, array_like=True, kw_only=True):
    """One sampled response to one prompt, tagged with the policy versions that made it.

    ``group_id`` names the GRPO group (one prompt, ``group_size`` samples); the
    buffer hands a group out only whole. ``token_versions[i]`` is the policy
    version that generated ``response_ids[i]`` (a weight update can land
    mid-sequence), so staleness = learner_version - min(token_versions).
    """

    schema: int = SCHEMA_VERSION
    uid: str  # unique per sample: "<group_id>/<sample_index>"
    group_id: str
    group_size: int
    prompt_ids: Array  # int32
    response_ids: Array  # int32
    behavior_logprobs: (
        Array  # float32, logprob of each response token under the sampling distribution
    )
    token_versions: Array  # int32, one per response token
    score: float
    finish_reason: str  # "stop" | "length" | "abort"
    data_source: str = ""
    engine_id: str = ""
    prompt_index: int = -1  # dataset cursor position of the prompt (for exact resume)
    reward_metrics: dict[str, float] = {}
    timings: dict[str, float] = {}  # e.g. {"generate_s": ..., "reward_s": ...}
    temperature: float = 1.0  # the learner recomputes logprobs at this temperature

    def min_version(self) -> int:
        versions = self.token_versions.numpy()
        return int(versions.min()) if len(versions) else -1

    def validate(self) -> None:
        """Raise WireError if the message is internally inconsistent."""
        if self.schema != SCHEMA_VERSION:
            raise WireError(f"schema {self.schema} != supported {SCHEMA_VERSION}")
        n = len(self.response_ids)
        if len(self.behavior_logprobs) != n or len(self.token_versions) != n:
            raise WireError(
                f"trajectory {self.uid}: response has {n} tokens but "
                f"{len(self.behavior_logprobs)} logprobs and {len(self.token_versions)} versions"
            )
        if self.group_size < 1:
            raise WireError(f"trajectory {self.uid}: group_size {self.group_size} < 1")
        if len(self.prompt_ids) == 0:
            raise WireError(f"trajectory {self.uid}: empty prompt")


ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def decoder(typ: type) -> msgspec.msgpack.Decoder:
    """The reused decoder for ``typ`` (built once per type)."""
    dec = _DECODERS.get(typ)
    if dec is None:
        dec = _DECODERS[typ] = msgspec.msgpack.Decoder(typ)
    return dec


def encode(message: msgspec.Struct) -> bytes:
    return ENCODER.encode(message)


def decode_trajectory(frame: bytes | memoryview) -> Trajectory:
    """Decode and validate one trajectory frame; raise WireError on anything wrong."""
    try:
        traj = decoder(Trajectory).decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError(f"malformed trajectory frame: {err}") from None
    traj.validate()
    return traj
