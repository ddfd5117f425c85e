"""Load a user's reward function from a Python file by path (verl's ``custom_reward_function``).

The file is imported as a fresh module (its top level runs once, in this
process) and ``function_name`` is taken from it. Its signature decides how it is
called, always with keywords, as verl calls it:

- single: ``fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)``
  -> a float or a dict with "score" (verl's naive reward manager), once per sample
  as the sample finishes;
- batched: ``fn(data_sources, solution_strs, ground_truths, extra_infos,
  **reward_kwargs)`` -> a list with one float or dict per item (verl's
  ``BatchRewardManager`` signature), once per group with the group's samples;
- either may be ``async def``: it is awaited on the rollout's event loop (with
  the timeout); a plain function runs in a worker thread.

Judge access: a function that declares any of ``JUDGE_KEYWORDS`` (or takes
``**kwargs``) is also handed the addresses of the run's reward servers and rollout
engines (rollout_fleet/rewards/judge.py); their keys (``SECRET_KEYWORDS``) only when it
names them: a function that takes ``**kwargs`` and logs them does not leak the run's key.

Everything is checked here, before any rollout: the file exists and imports,
the name is a callable, and the call the pipeline will make binds to the
signature (the four keywords of its kind plus every ``reward_kwargs`` key). A
problem raises ``RewardLoadError`` with one line naming the file and what is
wrong.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_fleet.rewards.judge import JUDGE_KEYWORDS, SECRET_KEYWORDS

REWARD_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_REWARD_PARAMETERS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class RewardLoadError(ValueError):
    """A custom reward file or function that cannot be used."""


@dataclass(frozen=True)
class CustomReward:
    """A loaded reward function and how to call it."""

    fn: Callable[..., Any]
    name: str  # "<function> in <file>", for messages
    batched: bool = False  # verl's BatchRewardManager signature: one call per group
    is_async: bool = False
    judge_keywords: frozenset[str] = frozenset()  # judge-access keywords it is handed
    reward_kwargs: Mapping[str, Any] = field(default_factory=dict)


def _parameters(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins and some C callables have no signature to check


def _is_async(fn: Any) -> bool:
    # a callable object with an ``async def __call__`` is awaited too
    call = fn.__call__ if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def describe(fn: Callable[..., Any], where: str, reward_kwargs: Mapping[str, Any]) -> CustomReward:
    """Classify ``fn`` (single or batched, sync or async, judge keywords) and check that the
    call the pipeline makes binds to it; ``RewardLoadError`` naming ``where`` if not."""
    signature = _parameters(fn)
    names = set(signature.parameters) if signature is not None else set()
    batched = {"data_sources", "solution_strs"} <= names
    keywords = BATCH_REWARD_PARAMETERS if batched else REWARD_PARAMETERS
    judge: frozenset[str] = frozenset()
    if signature is not None:
        takes_any = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
        )
        # **kwargs gets the addresses; a key goes only to a function that names it
        judge = frozenset(names & set(JUDGE_KEYWORDS))
        if takes_any:
            judge |= frozenset(JUDGE_KEYWORDS) - SECRET_KEYWORDS
        clash = sorted(set(reward_kwargs) & (set(keywords) | set(JUDGE_KEYWORDS)))
        if clash:
            raise RewardLoadError(
                f"reward_kwargs {clash} of {where} would replace arguments the pipeline passes"
            )
        try:
            signature.bind(**dict.fromkeys([*keywords, *reward_kwargs, *judge]))
        except TypeError as err:
            kind = "a batched reward function" if batched else "a reward function"
            extra = f" and reward_kwargs {sorted(reward_kwargs)}" if reward_kwargs else ""
            raise RewardLoadError(
                f"{where} cannot be called as {kind} with keywords {', '.join(keywords)}"
                f"{extra}: {err}"
            ) from None
    return CustomReward(
        fn=fn,
        name=where,
        batched=batched,
        is_async=_is_async(fn),
        judge_keywords=judge,
        reward_kwargs=dict(reward_kwargs),
    )


def _import(file: Path) -> Any:
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
    return module


def load_custom_reward(
    path: str | Path,
    function_name: str = "compute_score",
    reward_kwargs: Mapping[str, Any] | None = None,
) -> CustomReward:
    """The callable ``function_name`` defined in the Python file at ``path``, classified."""
    file = Path(path)
    if not file.is_file():
        raise RewardLoadError(f"custom reward file {file} not found")
    module = _import(file)
    fn = getattr(module, function_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(
            f"custom reward file {file} defines no {function_name!r}; callables found: "
            f"{', '.join(public) or 'none'}"
        )
    if not callable(fn):
        raise RewardLoadError(f"{function_name!r} in {file} is a {type(fn).__name__}, not callable")
    return describe(fn, f"{function_name!r} in {file}", reward_kwargs or {})
