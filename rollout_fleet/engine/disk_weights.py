"""Read a whole checkpoint folder for ``/update_weights_from_disk``, checked against the model.

SGLang's route loads every tensor of a Hugging Face folder into the running
model in place. The embedded engine does the same from the folder's
``*.safetensors`` files, and first refuses a folder that would leave the model
half old, half new: every weight the model serves must be in the files (a tied
weight, such as an LM head sharing the embedding's storage, counts as present
when the tensor it shares is). Unknown names and wrong shapes are refused by
``ModelRunner.load_weights``, which validates everything before the first copy,
so a refused folder changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_fleet.engine.runner import WeightLoadError


def read_checkpoint(
    folder: str | Path, served: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of ``folder``'s safetensors files, on the CPU.

    ``served`` is the model's ``named_weights()``. Raises ``FileNotFoundError`` for a
    folder without safetensors files and ``WeightLoadError`` when one of the served
    weights is missing from them.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder this engine can read")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files (only safetensors is read)")
    named: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file), device="cpu").items():
            if name in named:
                raise WeightLoadError(f"{name!r} appears in more than one file of {folder}")
            named[name] = tensor
    present_storage = {served[n].data_ptr() for n in named if n in served}
    missing = sorted(
        n for n, t in served.items() if n not in named and t.data_ptr() not in present_storage
    )
    if missing:
        raise WeightLoadError(
            f"{folder} lacks {len(missing)} of the served model's weights (e.g. {missing[:3]});"
            " loading it would serve a mix of two checkpoints"
        )
    return list(named.items())
