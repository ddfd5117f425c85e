"""Which embedded engine serves a model folder: generation, or a reward model's scores.

A folder whose ``config.json`` names a ``*ForSequenceClassification`` architecture (what
``fleetrl rm train`` writes, and what SGLang serves as a reward model) gets the
``RewardEngine`` (``/classify``, ``/encode``); any other folder the generation engine
(``/generate``). ``fleetrl engine`` and the fleet's engine actors both open engines here,
so a reward fleet and a rollout fleet start the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetrl.models.reward_folder import is_sequence_classifier
from rollout_fleet.engine.score_runner import MAX_BATCH_TOKENS


def open_engine(
    model_path: str | Path,
    *,
    engine_id: str,
    device: str = "cpu",
    dtype: str = "float32",
    max_running_requests: int = 64,
    api_key: str | None = None,
    require_api_key: bool = False,
    num_threads: int | None = 1,
    log_requests: bool = False,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
    memory_saver: bool = False,
) -> Any:
    """The embedded engine for ``model_path`` (not yet serving): ``RewardEngine`` for a
    sequence classifier, else ``EmbeddedEngine`` (``memory_saver``: its released memory is
    freed, SGLang's ``--enable-memory-saver``)."""
    common: dict[str, Any] = dict(
        engine_id=engine_id,
        device=device,
        dtype=dtype,
        max_running_requests=max_running_requests,
        api_key=api_key,
        require_api_key=require_api_key,
        num_threads=num_threads,
    )
    if is_sequence_classifier(model_path):
        from rollout_fleet.engine.reward_server import RewardEngine

        return RewardEngine(
            str(model_path),
            log_requests=log_requests,
            max_batch_tokens=max_batch_tokens,
            **common,
        )
    from rollout_fleet.engine.server import EmbeddedEngine

    return EmbeddedEngine(str(model_path), memory_saver=memory_saver, **common)
