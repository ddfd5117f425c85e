"""LoRA adapters on the wire: their names, their folders, and reading one back.

With ``learner.lora.rank > 0`` a policy version is an adapter over fixed base
weights. Version ``v`` travels as a PEFT adapter folder (what
``PeftModel.save_pretrained`` writes: ``adapter_model.safetensors`` holding the
keys of ``peft.get_peft_model_state_dict`` and ``adapter_config.json``) and is
known to engines by the name ``adapter_name(v)`` = ``fleetrl-policy-v<v>``:
SGLang's ``/load_lora_adapter`` takes a name and a path, and a ``/generate``
request picks an adapter by that name (``lora_path``). The name carries the
version, so a rollout worker tags the tokens of a request with the version of
the adapter it named (``adapter_version``).

``write_adapter_folder`` writes a folder atomically (a temporary folder, then one
``rename``), so an engine never reads half an adapter; ``read_adapter_folder``
is the engine side (the embedded engine, the reference engine, tests).

Left out: adapters that add tokens or train other modules in full
(``modules_to_save``), DoRA; ``read_adapter_folder`` refuses them by name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the rollout side imports the names without torch
    import torch

ADAPTER_PREFIX = "fleetrl-policy"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_LORA_KEY_PARTS = (".lora_A.", ".lora_B.")


def adapter_name(version: int) -> str:
    """The name engines know the adapter of policy ``version`` by."""
    if version < 0:
        raise ValueError(f"adapter version must be >= 0, got {version}")
    return f"{ADAPTER_PREFIX}-v{version}"


def adapter_version(name: str) -> int:
    """The policy version an ``adapter_name`` denotes; ValueError for any other name."""
    prefix = ADAPTER_PREFIX + "-v"
    digits = name[len(prefix) :] if name.startswith(prefix) else ""
    if not digits.isdigit():
        raise ValueError(f"{name!r} is not a fleetrl adapter name ({prefix}<version>)")
    return int(digits)


def write_adapter_folder(
    root: str | Path,
    name: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: dict[str, Any],
) -> tuple[Path, int]:
    """Write ``<root>/<name>`` (safetensors + adapter_config.json) atomically.

    Returns the folder and the bytes of tensor data written. An existing folder
    of that name is replaced (a version published again after a failure).
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        state: dict[str, torch.Tensor] = {}
        for key, tensor in tensors:
            if key in state:
                raise ValueError(f"adapter tensor {key!r} appears twice in the stream")
            state[key] = tensor.detach().to("cpu").contiguous()
        if not state:
            raise ValueError("the adapter stream is empty: is LoRA on in the learner?")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=sorted))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, nbytes


def existing_adapter_folders(root: str | Path) -> list[str]:
    """The adapter folders under ``root``, oldest version first; half-written ones (a
    writer that died before its rename) are deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[tuple[int, str]] = []
    for path in root.iterdir():
        if path.name.startswith(f".{ADAPTER_PREFIX}-v") and ".tmp-" in path.name:
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            found.append((adapter_version(path.name), path.name))
        except ValueError:
            continue  # not ours
    return [name for _, name in sorted(found)]


def remove_adapter_folder(root: str | Path, name: str) -> None:
    """Delete ``<root>/<name>`` if present (an adapter no engine may load any more)."""
    shutil.rmtree(Path(root) / name, ignore_errors=True)


@dataclass(frozen=True)
class LoraWeights:
    """One adapter as an engine applies it: per target module, ``delta = scale * B @ A``."""

    config: dict[str, Any]
    a: dict[
        str, torch.Tensor
    ]  # module name (HF, e.g. model.layers.0.self_attn.q_proj) -> A [r, in]
    b: dict[str, torch.Tensor]  # module name -> B [out, r]
    scale: float
    fan_in_fan_out: bool

    def delta(self, module: str) -> torch.Tensor:
        """The weight update of ``module`` in the module's ``[out, in]`` layout."""
        update = (self.b[module].float() @ self.a[module].float()) * self.scale
        return update.T if self.fan_in_fan_out else update


def read_adapter_folder(path: str | Path) -> LoraWeights:
    """Read a PEFT LoRA folder; ValueError naming the folder and the problem otherwise."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"{path} is not a PEFT adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    config = json.loads(config_file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"{config_file}: DoRA adapters are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{config_file}: per-module {key} is not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (rank**0.5) if config.get("use_rslora") else alpha / rank
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(weights_file)).items():
        module, part = _split_key(key, path)
        (a if part == "A" else b)[module] = tensor
    missing = set(a) ^ set(b)
    if missing:
        raise ValueError(
            f"{weights_file}: modules without both lora_A and lora_B: {sorted(missing)[:5]}"
        )
    return LoraWeights(
        config=config,
        a=a,
        b=b,
        scale=scale,
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
    )


def _split_key(key: str, path: Path) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (``<module>``, "A")."""
    for part in _LORA_KEY_PARTS:
        if part in key and key.endswith(".weight"):
            module = key.split(part, 1)[0].removeprefix("base_model.model.")
            return module, part[-2]
    raise ValueError(
        f"{path}: tensor {key!r} is not a LoRA A/B weight (modules_to_save, embeddings and"
        " DoRA magnitudes are not supported)"
    )
