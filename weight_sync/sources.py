"""Weight streams from outside training: the tensors a model publishes, by the learner's rule.

The learner publishes ``policy.state_dict()`` order, parameters and persistent
buffers, each tied parameter once under the name ``named_parameters()`` gives it
(``learner.worker.LearnerWorker.named_full_tensors``), under the names the model's
files give them (``fleetrl.models.checkpoint_names``). ``module_named_tensors``
applies the same rule to any module, so a model loaded from a folder or a
checkpoint (``fleetrl weights push``, tests, benchmarks) is sent exactly as the
learner would send it.
"""

from __future__ import annotations

import torch


def module_named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the learner publishes for a model (see the module docstring)."""
    from fleetrl.models.checkpoint_names import CheckpointNames

    wanted = {name for name, _ in module.named_parameters()}
    wanted |= {name for name, _ in module.named_buffers()}
    files = CheckpointNames.of(module)
    return [(files.to_file(name), t) for name, t in module.state_dict().items() if name in wanted]
