"""Model and tokenizer loading (any local Hugging Face causal LM folder) and the
tiny random-init models the project builds for CPU runs and tests."""

from fleetrl.models.config import ModelConfig

__all__ = ["ModelConfig"]
