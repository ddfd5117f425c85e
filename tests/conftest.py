"""Shared fixtures: tiny random-init model folders (policy, Llama, reward model, one of each
family) made once per session, CPU torch settings."""

from __future__ import annotations

import os

import pytest

os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a test that makes a check fail would otherwise read an earlier test's remembered pass
# (launcher.preflight_memo); the memo's own tests turn it on in a folder of their own
os.environ.setdefault("FLEETRL_CACHE_DIR", "off")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen2-shaped model (hidden 64) with the project's character tokenizer."""
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", layers=2, hidden=64, heads=4, seed=0
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama") / "model",
        arch="llama",
        layers=2,
        hidden=64,
        heads=4,
        seed=0,
    )


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory):
    """A one-label Qwen2ForSequenceClassification (a reward model) with the same tokenizer."""
    from fleetrl.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_rm") / "model",
        layers=2,
        hidden=64,
        heads=4,
        seed=1,
        reward_model=True,
    )


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """``tiny_family(name)``: a 2-layer tiny model folder of that family with its own tokenizer
    (``fleetrl.models.tiny.FAMILIES``), built once a session."""
    from fleetrl.models.tiny import make_tiny_model

    built = {}

    def get(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp(f"tiny_{family}") / "model"
            built[family] = make_tiny_model(
                folder, arch=family, layers=2, hidden=32, heads=4, max_positions=128, seed=0
            )
        return built[family]

    return get
