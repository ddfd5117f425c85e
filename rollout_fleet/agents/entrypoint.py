"""The agent contract and how ``rollout.agent.entrypoint`` names one.

An agent is a function, called once per episode with keywords::

    run(base_url: str, api_key: str, sample: dict) -> float | None

``base_url`` (``http://HOST:PORT/v1``) and ``api_key`` are this episode's: hand
them to ``openai.OpenAI`` / ``AsyncOpenAI``, LangChain's ``ChatOpenAI``, the
OpenAI Agents SDK, or a process or container of your own (passed explicitly, not
through process-wide environment variables, which race between concurrent
episodes). ``sample`` is the dataset row: ``prompt`` (chat messages),
``data_source``, ``reward_model`` (``ground_truth``), ``extra_info``, ``ability``
(a copy: changing it changes nothing). An ``async def`` runs on the rollout
worker's event loop (it must not block it); a plain function runs in a thread.
It returns the episode's reward, or None to let the run's reward pipeline (rules,
your reward function, a reward model) score the last assistant message against
the row.

``rollout.agent.entrypoint`` is ``path/to/file.py:function`` (a file anywhere,
relative to the working directory) or ``module:function`` (importable).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_KEY = "rollout.agent.entrypoint"
AGENT_PARAMETERS = ("base_url", "api_key", "sample")
AgentFn = Callable[..., Any]


class AgentLoadError(ValueError):
    """``rollout.agent.entrypoint`` names nothing usable."""


def check_entrypoint_spec(spec: str) -> None:
    """Refuse (``ValueError``) a spec that is not ``target:function``."""
    target, _, function = spec.rpartition(":")
    if not target or not function.isidentifier():
        raise ValueError(
            f"entrypoint {spec!r} is neither 'path/to/file.py:function' nor 'module:function'"
        )


def _module(target: str) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise AgentLoadError(f"{CONFIG_KEY}: file not found: {path}")
        name = f"fleetrl_agent_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise AgentLoadError(f"{CONFIG_KEY}: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code: one line naming the file and the cause
            del sys.modules[name]
            raise AgentLoadError(f"{CONFIG_KEY}: {path} fails to import: {err!r}") from err
        return module
    try:
        return importlib.import_module(target)
    except Exception as err:  # user code, as above
        raise AgentLoadError(f"{CONFIG_KEY}: cannot import module {target!r}: {err!r}") from err


def load_agent(spec: str) -> AgentFn:
    """The agent function ``spec`` names (see the module docstring)."""
    try:
        check_entrypoint_spec(spec)
    except ValueError as err:
        raise AgentLoadError(f"{CONFIG_KEY}: {err}") from None
    target, _, function = spec.rpartition(":")
    fn = getattr(_module(target), function, None)
    if not callable(fn):
        raise AgentLoadError(f"{CONFIG_KEY}: {target} has no function {function!r}")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(AGENT_PARAMETERS))
    except TypeError as err:
        raise AgentLoadError(
            f"{CONFIG_KEY}: {spec} cannot be called with keywords "
            f"{', '.join(AGENT_PARAMETERS)}: {err}"
        ) from None
    except ValueError:
        pass  # some callables have no signature to check
    return fn


def sample_row(prompt: Any) -> dict[str, Any]:
    """The dataset row an agent gets, from a ``fleetrl.data.reader.PromptItem``."""
    return {
        "prompt": [dict(m) for m in prompt.raw_prompt],
        "data_source": prompt.data_source,
        "reward_model": {"style": "rule", "ground_truth": prompt.ground_truth},
        "extra_info": dict(prompt.extra_info),
        "ability": prompt.ability,
        "index": prompt.index,
    }
