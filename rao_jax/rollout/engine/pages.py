"""The KV cache's page pool, host side: a free list and a reference count per page (numpy).

The device holds one pool of ``num_pages`` pages of ``page_size`` slots per layer
(``rao_jax.kernels.paged``); which pages a context uses is decided here. A context's pages are
a plain list (slot j of the context lives in page ``pages[j // page_size]``); the slot table
keeps one per slot and turns it into the int32 page-table rows the programs take
(``table_row``). A page is shared when several contexts hold it (a common prompt prefix): its
count is their number, and it returns to the free list when the last one lets go. A shared page
is read-only: a context about to write into one gets its own copy first (``SlotTable.reserve``).
Plain Python, no JAX.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


class PoolExhausted(RuntimeError):
  """No free page, and nothing the caller could free."""


class PagePool:
  """A fixed pool of KV-cache pages.

  Args:
    num_pages: pages in the pool (``EngineConfig.num_pages``).
    page_size: slots (token positions) per page (``EngineConfig.page_size``).
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"PagePool: num_pages={num_pages!r} and page_size={page_size!r} must be "
                       ">= 1 (EngineConfig validates them).")
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    self.refs = np.zeros(self.num_pages, np.int32)
    # A stack popped from the end: pages are handed out 0, 1, 2, ... and a freed page is the
    # next one reused (its memory is the most likely to be warm).
    self._free = list(range(self.num_pages - 1, -1, -1))

  @property
  def num_free(self) -> int:
    """Pages no context holds."""
    return len(self._free)

  def pages_for(self, n_slots: int) -> int:
    """Pages that hold slots [0, n_slots)."""
    return -(-int(n_slots) // self.page_size)

  def alloc(self) -> int:
    """A free page, now held once.

    Raises:
      PoolExhausted: every page is held (the slot table frees some first; see
        ``SlotTable.reserve``).
    """
    if not self._free:
      raise PoolExhausted(f"all {self.num_pages} KV pages are in use; raise "
                          "EngineConfig.num_pages (or lower num_slots / max_len).")
    page = self._free.pop()
    self.refs[page] = 1
    return page

  def share(self, pages: Iterable[int]) -> list[int]:
    """The same pages, held once more each (another context now reads them)."""
    pages = list(pages)
    if pages and np.any(self.refs[pages] < 1):
      raise ValueError(f"PagePool.share: pages {pages} include free ones.")
    np.add.at(self.refs, pages, 1)
    return pages

  def release(self, pages: Iterable[int]) -> None:
    """Lets go of one hold on each page; pages no longer held return to the free list."""
    for page in pages:
      if self.refs[page] < 1:
        raise ValueError(f"PagePool.release: page {page} is not held (released twice).")
      self.refs[page] -= 1
      if self.refs[page] == 0:
        self._free.append(page)

  def exclusive(self, page: int) -> bool:
    """Whether exactly one context holds ``page`` (so it may write into it)."""
    return self.refs[page] == 1

  def check(self, held: Iterable[list[int]]) -> None:
    """Raises AssertionError unless the counts equal the holds in ``held`` (every context's
    pages) and every other page is free exactly once: the pool's invariant, for tests."""
    want = np.zeros(self.num_pages, np.int32)
    for pages in held:
      np.add.at(want, list(pages), 1)
    assert np.array_equal(want, self.refs), (want, self.refs)
    assert sorted(self._free) == [p for p in range(self.num_pages) if want[p] == 0]


def table_row(pages: list[int], width: int) -> np.ndarray:
  """A context's pages as one int32 page-table row of ``width`` entries, -1 past them (a page
  it does not have: writes there are dropped, reads masked)."""
  row = np.full(width, -1, np.int32)
  n = min(len(pages), width)
  row[:n] = pages[:n]
  return row


__all__ = ["PagePool", "PoolExhausted", "table_row"]
