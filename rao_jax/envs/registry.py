"""Environments by name, so configs and command lines can say `env.name = "textcraft_synth"`."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from rao_jax.envs import base


def _textcraft(**kw) -> base.Environment:
  from rao_jax.envs import textcraft  # pylint: disable=g-import-not-at-top
  return textcraft.TextCraftEnv(**kw)


def _textcraft_synth(**kw) -> base.Environment:
  from rao_jax.envs import textcraft_synth  # pylint: disable=g-import-not-at-top
  return textcraft_synth.TextCraftSynthEnv(textcraft_synth.SynthConfig(**kw))


def _longcontext(**kw) -> base.Environment:
  from rao_jax.envs import longcontext  # pylint: disable=g-import-not-at-top
  return longcontext.LongContextEnv(**kw)


def _search(**kw) -> base.Environment:
  from rao_jax.envs import search  # pylint: disable=g-import-not-at-top
  return search.SearchEnv(**kw)


ENVIRONMENTS: dict[str, Callable[..., base.Environment]] = {
    "textcraft": _textcraft,
    "textcraft_synth": _textcraft_synth,
    "longcontext": _longcontext,
    "search": _search,
}


def make_env(name: str, kwargs: Mapping[str, Any] | None = None) -> base.Environment:
  """Builds the environment registered as `name` with keyword options `kwargs`."""
  if name not in ENVIRONMENTS:
    raise ValueError(f"Unknown environment {name!r}; known: {sorted(ENVIRONMENTS)} "
                     "(set --config.env.name).")
  try:
    return ENVIRONMENTS[name](**dict(kwargs or {}))
  except TypeError as e:
    raise ValueError(f"Environment {name!r} rejected options {dict(kwargs or {})}: {e} "
                     "(check --config.env.kwargs).") from e


def split_name(env: base.Environment, split: str, difficulty: str | None) -> str:
  """The task split holding `difficulty` ("all" or None: the whole split)."""
  if difficulty in (None, "", "all"):
    return split
  return f"{split}/{difficulty}"
