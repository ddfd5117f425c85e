"""Load a local Hugging Face causal LM or sequence classifier (reward model) folder and its
tokenizer (Qwen2, Llama, ...).

Nothing is downloaded: paths must exist locally (``local_files_only``), and a
missing or incomplete folder is a clear error naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ModelPathError(FileNotFoundError):
    pass


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelPathError(f"model path {p} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"model path {p} has no config.json: not a Hugging Face model folder")
    return p


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(path)), local_files_only=True)


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_causal_lm(path: str | Path, dtype: str = "float32", **kwargs: Any):
    """``AutoModelForCausalLM`` from a local folder, in ``dtype`` (float32 | bfloat16 | float16)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(check_model_dir(path)), dtype=_torch_dtype(dtype), local_files_only=True, **kwargs
    )


def load_sequence_classifier(path: str | Path, dtype: str = "float32", **kwargs: Any):
    """``AutoModelForSequenceClassification`` (a reward model) from a local folder, in ``dtype``."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        str(check_model_dir(path)), dtype=_torch_dtype(dtype), local_files_only=True, **kwargs
    )
