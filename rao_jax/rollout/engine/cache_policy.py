"""The cache-length policy: which length bucket the KV cache should have now.

The cache length follows the longest context currently held, so decoding short contexts does
not pay attention over the longest one. It grows at once (a context cannot wait) and shrinks
only after the need has stayed at most half the current length for ``shrink_patience``
scheduler steps in a row (resizing back and forth would cost more than it saves). Plain
Python: the scheduler applies the decision with the device program ``resize``.
"""
from __future__ import annotations

from typing import Sequence

from rao_jax.rollout.engine.config import bucket


class CacheLenPolicy:
  """Decides the cache length, one scheduler step at a time.

  Args:
    cache_lens: the length buckets, ascending (``EngineConfig.cache_lens``).
    shrink_patience: steps of low need before shrinking (``EngineConfig.shrink_patience``).
  """

  def __init__(self, cache_lens: Sequence[int], shrink_patience: int):
    if not cache_lens or list(cache_lens) != sorted(set(cache_lens)):
      raise ValueError(f"CacheLenPolicy: cache_lens={tuple(cache_lens)!r} must be a non-empty "
                       "ascending tuple (EngineConfig validates it).")
    if shrink_patience < 1:
      raise ValueError(f"CacheLenPolicy: shrink_patience={shrink_patience!r} must be >= 1.")
    self.cache_lens = tuple(cache_lens)
    self.shrink_patience = shrink_patience
    self.length = self.cache_lens[0]     # the cache's current length
    self._low_need_steps = 0

  def plan(self, needed: int, allow_shrink: bool) -> int | None:
    """The new cache length when the cache must be resized now, else None.

    Args:
      needed: the most tokens any row must hold after this step.
      allow_shrink: whether this step may count towards (and do) a shrink. Prefill steps pass
        False: a prompt arriving is a sign the need is about to grow again.

    Returns:
      The length to resize to (``self.length`` already holds it), or None to keep the cache.
    """
    target = bucket(self.cache_lens, needed)
    if target > self.length:
      self._low_need_steps = 0
      self.length = target
      return target
    if allow_shrink and target * 2 <= self.length:
      self._low_need_steps += 1
      if self._low_need_steps >= self.shrink_patience:
        self._low_need_steps = 0
        self.length = target
        return target
      return None
    self._low_need_steps = 0
    return None
