"""No code can run from bytes that arrive on a socket or from a checkpoint.

Scans the source of every library package (the AST, not the text, so comments and
docstrings do not count) and fails on: an import of pickle, cloudpickle, dill or
marshal; ZeroMQ's pickling helpers (send_pyobj/recv_pyobj/send_serialized/
recv_serialized); torch.distributed's object collectives (they pickle); numpy loads
with allow_pickle; any torch.load without weights_only=True. Then checks that the
wire decoders really are typed msgspec decoders.

``bench/`` is left out on purpose: its transport benchmark measures the cloudpickled Ray
queue that peers use, as the baseline. One library module is let through by name
(``PICKLE_EXCEPTIONS``): ``weight_sync/ipc_payload.py``, because SGLang's
``/update_weights_from_tensor`` protocol *is* a ForkingPickler payload (tensors by
shared-memory or CUDA-IPC handle, between processes on one host); a test here checks
that it decodes only through its allow-list unpickler.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY_PACKAGES = ["buffer", "rollout_fleet", "learner", "weight_sync", "launcher", "fleetrl"]
PICKLING_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
PICKLING_CALLS = {
    "send_pyobj",
    "recv_pyobj",
    "send_serialized",
    "recv_serialized",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


# module -> why it may pickle (a protocol we share with SGLang, not a wire we own)
PICKLE_EXCEPTIONS = {
    "weight_sync/ipc_payload.py": "SGLang's /update_weights_from_tensor payload format",
}


def _library_files() -> list[Path]:
    files = [
        p
        for pkg in LIBRARY_PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        if str(p.relative_to(REPO)) not in PICKLE_EXCEPTIONS
    ]
    assert len(files) > 50, "the scan found too few files: wrong repository root?"
    return files


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[-1] in PICKLING_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {module.split(".")[-1], *(a.name for a in node.names)}
            if names & PICKLING_MODULES:
                found.append(f"{where}: from {module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            keywords = {k.arg: k.value for k in node.keywords}
            if name in PICKLING_CALLS:
                found.append(f"{where}: {name}() pickles")
            if name == "load" and isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "torch":
                    flag = keywords.get("weights_only")
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        found.append(f"{where}: torch.load without weights_only=True")
            flag = keywords.get("allow_pickle")
            if isinstance(flag, ast.Constant) and flag.value is True:
                found.append(f"{where}: allow_pickle=True")
    return found


def test_no_library_module_pickles_or_loads_untrusted_objects():
    problems = [p for path in _library_files() for p in _problems(path)]
    assert problems == []


def test_the_pickle_exception_decodes_only_through_its_allow_list_unpickler():
    """ipc_payload never calls pickle.load(s) or a plain Unpickler: only RestrictedUnpickler,
    whose find_class refuses every global outside ALLOWED_GLOBALS."""
    (module,) = PICKLE_EXCEPTIONS
    tree = ast.parse((REPO / module).read_text())
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not calls & {"pickle.load", "pickle.loads", "pickle.Unpickler", "torch.load"}
    unpicklers = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(b) == "pickle.Unpickler" for b in node.bases)
    ]
    assert [c.name for c in unpicklers] == ["RestrictedUnpickler"]
    assert "find_class" in {f.name for f in unpicklers[0].body if isinstance(f, ast.FunctionDef)}
    assert "RestrictedUnpickler(io.BytesIO(raw)).load" in calls


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\n",
        "from ray import cloudpickle\n",
        "sock.recv_pyobj()\n",
        "torch.load(path)\n",
        "torch.load(path, weights_only=False)\n",
        "dist.broadcast_object_list(objs)\n",
        "np.load(f, allow_pickle=True)\n",
    ],
)
def test_the_scan_catches_each_forbidden_pattern(tmp_path, source):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _problems(path), f"the scan missed: {source!r}"


def test_wire_decoders_are_typed_msgspec_decoders():
    import msgspec

    from buffer import wire

    wire.decode_trajectory(wire.encode(_trajectory()))
    wire.decode_request(wire.encode(wire.GetStats()))
    wire.decode_reply(wire.encode(wire.Ack(value=1)))
    decoders = list(wire._DECODERS.values())
    assert len(decoders) >= 3
    for decoder in decoders:
        assert isinstance(decoder, msgspec.msgpack.Decoder)
        assert decoder.type is not object  # typed: unknown shapes are refused, not built
    with pytest.raises(wire.FrameError):  # a pickle stream is just a malformed frame
        import pickle  # noqa: S403 - the bytes of a pickle, never loaded

        wire.decode_request(pickle.dumps({"op": "stats"}))


def _trajectory():
    from buffer.synthetic import make_group

    return make_group("g", 1)[0]


def test_checkpoint_rng_state_loads_with_weights_only(tmp_path):
    """A tensor file carrying a pickled callable is refused by the checkpoint reader's load."""
    import pickle  # noqa: S403 - building the malicious file is the point of this test

    import torch

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    path = tmp_path / "rng_rank0.pt"
    with open(path, "wb") as f:
        pickle.dump({"torch_cpu": Evil()}, f)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


_UNPICKLED: list[str] = []


def _record_unpickling(tag: str) -> str:
    _UNPICKLED.append(tag)
    return tag


class _CallsOnLoad:
    def __reduce__(self):
        return (_record_unpickling, ("metadata",))


def test_a_checkpoint_is_trusted_input_its_dcp_metadata_is_unpickled(tmp_path):
    """Why the README calls a checkpoint trusted input: torch's distributed-checkpoint
    reader (what ``learner/checkpoint.py`` loads through) unpickles ``.metadata``, so a
    crafted file runs code when loaded. Only the RNG files, which are ours, load with
    ``weights_only=True``. If torch ever stops unpickling here, this test fails: then
    revisit the README's row."""
    import pickle  # noqa: S403 - building the crafted file is the point of this test

    from torch.distributed.checkpoint import FileSystemReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_CallsOnLoad()))
    _UNPICKLED.clear()
    with contextlib.suppress(AttributeError):  # what it returns is no Metadata: too late
        FileSystemReader(str(tmp_path)).read_metadata()
    assert _UNPICKLED == ["metadata"]
