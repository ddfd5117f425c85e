"""The environment contract of multi-turn rollouts, and how ``rollout.multi_turn.env`` names one.

An environment is a plain function, called with keywords after every
generated turn::

    env(messages: list[dict], extra_info: dict | None) -> dict | None

``messages`` is the conversation so far: the prompt's messages, then the
assistant turns (their text without special tokens) and the environment's
earlier replies, in order; the last message is the turn just generated. It
is a copy: changing it changes nothing. ``extra_info`` is the dataset row's.
The return value is the next observation, a message such as
``{"role": "tool", "content": "42"}`` (any role but ``assistant``; other
string keys pass to the chat template as they are), or None: the
conversation is done. The function runs in a thread, off the event loop,
with a timeout (``rollout_fleet.multi_turn.env_runner``).

``rollout.multi_turn.env`` is a built-in name (``BUILTIN_ENVS``) or
``"module:function"``, imported when the rollout worker starts; a name that
cannot be used raises ``EnvLoadError`` naming the key and the cause.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from rollout_fleet.multi_turn.calculator import calculator_env

EnvFn = Callable[..., "dict[str, Any] | None"]
ENV_PARAMETERS = ("messages", "extra_info")
CONFIG_KEY = "rollout.multi_turn.env"

BUILTIN_ENVS: dict[str, EnvFn] = {"calculator": calculator_env}


class EnvLoadError(ValueError):
    """``rollout.multi_turn.env`` names nothing usable."""


def check_env_name(spec: str) -> None:
    """Refuse (``ValueError``) a spec that is neither a built-in name nor ``module:function``."""
    module, _, function = spec.partition(":")
    if spec in BUILTIN_ENVS or (module and function and ":" not in function):
        return
    raise ValueError(
        f"env {spec!r} is neither a built-in environment ({', '.join(BUILTIN_ENVS)}) "
        "nor 'module:function'"
    )


def load_env(spec: str) -> EnvFn:
    """The environment function ``spec`` names (see the module docstring)."""
    try:
        check_env_name(spec)
    except ValueError as err:
        raise EnvLoadError(f"{CONFIG_KEY}: {err}") from None
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise EnvLoadError(f"{CONFIG_KEY}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise EnvLoadError(
            f"{CONFIG_KEY}: module {module_name!r} has no callable {function_name!r}"
        )
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ENV_PARAMETERS))
    except TypeError as err:
        raise EnvLoadError(
            f"{CONFIG_KEY}: {spec} cannot be called with keywords "
            f"{', '.join(ENV_PARAMETERS)}: {err}"
        ) from None
    except ValueError:
        pass  # some C callables have no signature to check
    return fn


def check_observation(value: Any, env_name: str, uid: str) -> dict[str, Any] | None:
    """``value`` as an observation message, or None for done; ``ValueError`` if it is neither."""
    if value is None:
        return None
    where = f"sample {uid}: environment {env_name!r} returned"
    if not isinstance(value, dict):
        raise ValueError(f"{where} a {type(value).__name__}, not a message dict or None")
    role, content = value.get("role"), value.get("content")
    if not isinstance(role, str) or not role or not isinstance(content, str):
        raise ValueError(f"{where} {sorted(value)}: a message needs string 'role' and 'content'")
    if role == "assistant":
        raise ValueError(f"{where} an 'assistant' message: only the policy speaks as assistant")
    return dict(value)
