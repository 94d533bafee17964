"""Segment ids of packed rows, and the shared prefixes they can name. Plain Python: the
learner's host-side packing writes them, the attention kernels read them (numpy or jax arrays).

A packed row holds several trajectories, each a segment: ids 1, 2, ... (0 = padding). Nodes
that start with the same tokens (every node of a tree repeats the system prompt; the trees of
a group share their whole root prompt) can instead share one copy of that prefix in the row:
prefix unit g of the row gets id -g, and the suffix of its m-th member id g * SUFFIX_BASE + m,
which sees the prefix and itself, never another member. Plain segments (ids below
SUFFIX_BASE) are unchanged, so one rule covers both layouts.
"""

SUFFIX_BASE = 1 << 16   # csrc/mkl_attention.cc's kSuffixBase


def shared_prefix_id(g: int) -> int:
  """The segment id of the shared prefix of unit ``g`` (1, 2, ... within a row)."""
  return -g


def suffix_id(g: int, m: int) -> int:
  """The segment id of the ``m``-th member's suffix (m >= 1) of shared-prefix unit ``g``."""
  if not (1 <= g < (1 << 15) and 1 <= m < SUFFIX_BASE):
    raise ValueError(f"suffix_id: unit {g} / member {m} outside [1, 32768) x [1, 65536)")
  return g * SUFFIX_BASE + m


def segments_see(seg_q, seg_k):
  """Whether a query of segment ``seg_q`` may see a key of segment ``seg_k`` (causality apart):
  the same segment, or the shared prefix its suffix continues. Broadcasts."""
  return (seg_q == seg_k) | ((seg_k < 0) & (seg_q // SUFFIX_BASE == -seg_k))
