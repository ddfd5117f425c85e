"""Slow preflight checks remembered by what they read, so an unchanged model is not checked twice.

Rendering prompts with the tokenizer, building the model's family on the meta device and
sizing its checkpoint import transformers and torch into ``fleetrl train``'s own process:
about 3.5 s of CPU before the roles start, on every run, for a result that depends only
on the model folder, a few config sections, the rows rendered and the installed code. A
check that passed is stored under a hash of exactly those inputs; a later run whose
inputs hash the same reads its findings (warnings included, logged again) instead of
checking again, and its driver never imports torch. A failed check is never stored: a
refused run checks again next time, and its error is always today's.

The key holds:
- the check's name and every input the caller names (config sections as their values,
  the rows rendered as their content);
- each named folder's files, recursively: name, size and modification time (the rule
  ``make`` uses: a file edited in place gets a new time; a folder made or deleted is a
  new key);
- the installed ``fleetrl``, ``transformers``, ``torch``, ``tokenizers`` and ``jinja2``
  versions and the source of the check modules (a new check or release checks again).

Where: ``$FLEETRL_CACHE_DIR/preflight`` (default ``$XDG_CACHE_HOME/fleetrl``, else
``~/.cache/fleetrl``), one small JSON file per key, written atomically.
``FLEETRL_CACHE_DIR=off`` checks every time. Left out: eviction (a key is a few hundred
bytes; deleting the folder is always safe).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from fleetrl.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")
OFF = "off"
PACKAGES = ("fleetrl", "transformers", "torch", "tokenizers", "jinja2")
_ROOT = Path(__file__).resolve().parent.parent
# the code whose answer is remembered: the checks, and what they call to render and build
CHECK_SOURCES = (
    "launcher/preflight_data.py",
    "launcher/preflight_model.py",
    "launcher/preflight_memo.py",
    "learner/memory.py",
    "fleetrl/data/render.py",
    "fleetrl/models/family.py",
    "fleetrl/models/loading.py",
    "fleetrl/models/packing_probe.py",
    "fleetrl/models/tiny.py",
)
MAX_FOLDER_FILES = 10_000  # a folder with more is not remembered (its walk would cost more)


def cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where remembered checks live (None: ``FLEETRL_CACHE_DIR=off``)."""
    env = os.environ if env is None else env
    chosen = env.get("FLEETRL_CACHE_DIR", "")
    if chosen.strip().lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser() / "preflight"
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fleetrl" / "preflight"


def folder_signature(path: str | Path) -> list[Any] | None:
    """(relative name, size, mtime_ns) of every file under ``path``, sorted; ["missing"]
    when there is no folder there; None when it is too large to walk cheaply."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return ["missing", str(root)]
    out: list[Any] = []
    for folder, _, files in os.walk(root, followlinks=True):
        for name in files:
            full = os.path.join(folder, name)
            try:
                st = os.stat(full)
            except OSError:  # a dangling link: its absence is part of the state
                out.append([os.path.relpath(full, root), -1, -1])
                continue
            out.append([os.path.relpath(full, root), st.st_size, st.st_mtime_ns])
            if len(out) > MAX_FOLDER_FILES:
                return None
    return [str(root.resolve()), sorted(out)]


@cache
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in PACKAGES:
        try:
            digest.update(f"{name}={importlib.metadata.version(name)};".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=none;".encode())
    for relative in CHECK_SOURCES:
        source = _ROOT / relative
        digest.update(relative.encode())
        digest.update(source.read_bytes() if source.is_file() else b"absent")
    return digest.hexdigest()


def memo_key(name: str, inputs: Mapping[str, Any], folders: Iterable[str | Path]) -> str | None:
    """The hash of everything the check reads (None: some folder is too large to sign)."""
    signatures = []
    for folder in folders:
        signature = folder_signature(folder)
        if signature is None:
            return None
        signatures.append(signature)
    payload = {"check": name, "inputs": inputs, "folders": signatures, "code": _code_fingerprint()}
    try:
        encoded = msgspec.json.encode(msgspec.to_builtins(payload, str_keys=True), order="sorted")
    except (TypeError, ValueError, msgspec.EncodeError) as err:  # a row value JSON cannot hold
        log.debug("preflight memo: %s not remembered (%s)", name, err)
        return None
    return hashlib.sha256(encoded).hexdigest()


def remembered(
    name: str,
    compute: Callable[[], T],
    *,
    inputs: Mapping[str, Any],
    folders: Iterable[str | Path] = (),
    result_type: Any,
    keep: Callable[[T], bool] = lambda _: True,
) -> tuple[T, bool]:
    """``compute()``'s result, or the one stored for the same inputs; and whether it was
    stored. A result ``keep`` refuses (a failed check) is returned, not stored."""
    where = cache_dir()
    key = memo_key(name, inputs, folders) if where is not None else None
    if where is None or key is None:
        return compute(), False
    path = where / f"{key}.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=result_type), True
    except FileNotFoundError:
        pass
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
        log.debug("preflight memo %s unreadable (%s): checking again", path, err)
    result = compute()
    if keep(result):
        _store(path, msgspec.json.encode(result))
    return result, False


def _store(path: Path, data: bytes) -> None:
    """Atomically; a cache that cannot be written costs the next run a check, nothing more."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        log.debug("preflight memo %s not written (%s)", path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
