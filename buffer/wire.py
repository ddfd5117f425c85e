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
    # uint8, one per response token: 1 = the policy's own token (trained), 0 = a token the
    # policy did not sample (a tool's or environment's reply inside a multi-turn response:
    # context for the tokens after it, no loss). None = every token is the policy's.
    loss_mask: Array | None = None
    # Why this sample's reward failed (a rule or custom function that raised, timed out or
    # returned a non-finite value, an unknown data_source, a reward-model batch that could
    # not be scored); "" = scored. A failed sample travels with its group but trains
    # nothing: no token of it is in any loss and its score (0.0) is in no group statistic.
    reward_error: str = ""
    # The agent episode this trajectory is a branch of ("<group_id>/e<index>"; an episode
    # whose agent rewrote its history is several trajectories, each with the episode's
    # reward); "" = not an agent rollout.
    episode: str = ""

    @property
    def reward_failed(self) -> bool:
        return bool(self.reward_error)

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
        if self.loss_mask is not None:
            if self.loss_mask.dtype != "uint8" or len(self.loss_mask) != n:
                raise WireError(
                    f"trajectory {self.uid}: loss_mask must be uint8 with one entry per response"
                    f" token ({n}), got {self.loss_mask.dtype} x {len(self.loss_mask)}"
                )
            if int(self.loss_mask.numpy().max(initial=0)) > 1:
                raise WireError(f"trajectory {self.uid}: loss_mask holds values other than 0/1")
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


# --------------------------------------------------------------------------------------
# Framing and the control protocol (DEALER <-> ROUTER), appended for the buffer service.
#
# Every ZeroMQ message is multipart: ``[header, payload]``. The header is 4 fixed bytes
# (magic b"FR", schema version, message kind) so a receiver can refuse a foreign or
# newer-schema message before spending any work decoding its payload. The payload is
# one msgpack-encoded struct. A control request is one ``Request`` (a tagged union:
# msgpack array whose first element is the op name); each gets exactly one ``Reply``
# carrying the same ``request_id`` so a client can discard late replies to requests it
# has already given up on.
# --------------------------------------------------------------------------------------

HEADER_MAGIC = b"FR"
KIND_TRAJECTORY = 1
KIND_REQUEST = 2
KIND_REPLY = 3
_KINDS = {KIND_TRAJECTORY, KIND_REQUEST, KIND_REPLY}


def make_header(kind: int) -> bytes:
    """The 4-byte header frame for a message of ``kind`` under this schema version."""
    return HEADER_MAGIC + bytes((SCHEMA_VERSION, kind))


TRAJECTORY_HEADER = make_header(KIND_TRAJECTORY)
REQUEST_HEADER = make_header(KIND_REQUEST)
REPLY_HEADER = make_header(KIND_REPLY)


class FrameError(WireError):
    """A frame rejected before or while decoding; ``reason`` is the counter key."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def check_header(frame: bytes | memoryview, expected_kind: int) -> None:
    """Raise FrameError(reason) unless ``frame`` is this schema's header for ``expected_kind``."""
    data = bytes(frame)
    if len(data) != 4 or data[:2] != HEADER_MAGIC or data[3] not in _KINDS:
        raise FrameError("bad_header", f"not a fleetrl header frame: {data[:8]!r}")
    if data[2] != SCHEMA_VERSION:
        raise FrameError("wrong_schema", f"schema version {data[2]} != supported {SCHEMA_VERSION}")
    if data[3] != expected_kind:
        raise FrameError("wrong_kind", f"message kind {data[3]} where {expected_kind} expected")


class _Request(msgspec.Struct, array_like=True, kw_only=True, tag=True):
    request_id: int = 0


class GetBatch(_Request, tag="get_batch"):
    """Long-poll for exactly ``num_groups`` whole groups (or an Empty after ``timeout_ms``).

    ``received_watermark`` is the consumer's count of groups received so far in hand-out
    order (-1 = not tracked). Hand-outs at or past it that the consumer never got (a lost
    reply, a buffer restart) are served again first, in their original order.
    """

    num_groups: int
    learner_version: int
    timeout_ms: int = 0
    received_watermark: int = -1


class PublishVersion(_Request, tag="publish_version"):
    """The learner published policy ``version`` (advances the admission window)."""

    version: int


class GetAdmission(_Request, tag="get_admission"):
    """Ask for the counters rollout workers pace admission with."""


class GetStats(_Request, tag="get_stats"):
    """Ask for every counter of the buffer."""


class Commit(_Request, tag="commit"):
    """Hand-outs below ``watermark`` are trained on and checkpointed: never serve them again.

    ``retain_groups``: groups a producer may still send again (prompts listed unfinished in
    a checkpoint that can still be resumed); the buffer keeps recognising them as closed
    while it prunes everything else that is committed (core.py, retention.py).
    """

    watermark: int
    retain_groups: list[str] = []


class Resume(_Request, tag="resume"):
    """The learner resumed from a checkpoint at ``version`` holding ``watermark``.

    Hand-outs at or past the watermark are served again, and ``accepted_groups`` is reset
    to ``version * groups_per_version`` plus the groups still waiting (see admission.py).
    """

    version: int
    watermark: int


class QueryGroups(_Request, tag="query_groups"):
    """How many samples of each group are durably accepted (for producers' resubmission)."""

    group_ids: list[str]


Request = GetBatch | PublishVersion | GetAdmission | GetStats | Commit | Resume | QueryGroups


class _Reply(msgspec.Struct, array_like=True, kw_only=True, tag=True):
    request_id: int = 0


class Batch(_Reply, tag="batch"):
    """``num_groups`` whole groups as Arrow IPC stream bytes (``arrow_batch.SCHEMA``).

    They are hand-outs ``[handout_start, handout_start + num_groups)`` in the buffer's
    global hand-out order; a consumer's received watermark becomes the end of that range.
    """

    arrow_ipc: bytes
    num_groups: int
    num_samples: int
    handout_start: int
    learner_version: int
    refused_stale: int = 0  # groups refused (too old) while composing this batch


class Empty(_Reply, tag="empty"):
    reason: str  # "timeout" | "shutting_down"


class AdmissionState(_Reply, tag="admission"):
    """The inputs of the staleness admission rule (buffer.admission.StalenessAdmission)."""

    policy_version: int
    accepted_groups: int
    max_staleness: int
    groups_per_version: int
    max_concurrent: int
    lead: int = -1  # versions ahead the fleet may generate now (buffer.lead); -1: max_staleness


class Stats(_Reply, tag="stats"):
    counters: dict[str, int | float]


class Ack(_Reply, tag="ack"):
    value: int = 0


class GroupStatus(_Reply, tag="group_status"):
    accepted_counts: list[int]  # per queried group: samples durably accepted (0 = unknown)


class Error(_Reply, tag="error"):
    message: str


Reply = Batch | Empty | AdmissionState | Stats | Ack | GroupStatus | Error


def decode_request(frame: bytes | memoryview) -> Request:
    try:
        return decoder(Request).decode(frame)  # type: ignore[arg-type]
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise FrameError("malformed", f"malformed request: {err}") from None


def decode_reply(frame: bytes | memoryview) -> Reply:
    try:
        return decoder(Reply).decode(frame)  # type: ignore[arg-type]
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise FrameError("malformed", f"malformed reply: {err}") from None
