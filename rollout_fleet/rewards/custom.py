"""Load a user's reward function from a Python file by path (verl's ``custom_reward_function``).

The file is imported as a fresh module (its top level runs once, in this
process) and ``function_name`` is taken from it. The function must accept
the keyword arguments ``data_source, solution_str, ground_truth, extra_info``
(it is called with keywords, as verl calls it) and return a float or a dict
with "score"; its signature is checked here, before any rollout.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from rollout_fleet.rewards.registry import RewardFn

REWARD_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardLoadError(ValueError):
    """A custom reward file or function that cannot be used."""


def _check_signature(fn: Any, where: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature to check
    try:
        signature.bind(**dict.fromkeys(REWARD_PARAMETERS))
    except TypeError as err:
        raise RewardLoadError(
            f"{where} cannot be called with keywords {', '.join(REWARD_PARAMETERS)}: {err}"
        ) from None


def load_custom_reward(path: str | Path, function_name: str = "compute_score") -> RewardFn:
    """The callable ``function_name`` defined in the Python file at ``path``."""
    file = Path(path)
    if not file.is_file():
        raise RewardLoadError(f"custom reward file {file} not found")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
    module_name = f"fleetrl_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"custom reward file {file} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's module failed at import: report it with its cause
        del sys.modules[module_name]
        raise RewardLoadError(f"importing custom reward file {file} failed: {err!r}") from err
    fn = getattr(module, function_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(
            f"custom reward file {file} defines no {function_name!r}; callables found: "
            f"{', '.join(public) or 'none'}"
        )
    if not callable(fn):
        raise RewardLoadError(f"{function_name!r} in {file} is a {type(fn).__name__}, not callable")
    _check_signature(fn, f"{function_name!r} in {file}")
    return fn
