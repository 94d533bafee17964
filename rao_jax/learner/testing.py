"""Tree builders for the learner's tests and benchmark (real `rao_jax.agent.records` records).

`synthetic_trees` grows trees shaped like the runtime's: a prompt, then turns of generated
tokens each followed by an observation, node lengths varying widely, children at random.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rao_jax.agent.records import NodeRecord, TreeRecord


def make_node(node_id: str, parent_id: str | None, depth: int, children: Sequence[str] = (),
              success: float | None = None, source: str | None = None,
              token_ids: Sequence[int] = (), gen_mask: Sequence[int] = (),
              logprobs: Sequence[float] | None = None) -> NodeRecord:
  """A scored NodeRecord; logprobs default to -1.0 on generated tokens."""
  gen = [int(g) for g in gen_mask]
  if logprobs is None:
    logprobs = [-1.0 if g else 0.0 for g in gen]
  return NodeRecord(
      node_id=node_id, parent_id=parent_id, depth=depth, goal=f"goal of {node_id}",
      children=list(children), token_ids=[int(t) for t in token_ids], gen_mask=gen,
      logprobs=[float(x) for x in logprobs], success=success,
      success_source=source if source is not None else (None if success is None else "verifier"),
      num_generated_tokens=sum(gen), end_reason="finish")


def make_tree(tree_id: str, group_id: str, nodes: Sequence[NodeRecord]) -> TreeRecord:
  return TreeRecord(tree_id=tree_id, group_id=group_id, task_id=group_id, env="test",
                    nodes=list(nodes))


def random_trajectory(rng: np.random.Generator, length: int, vocab: int,
                      prompt_frac: float = 0.3, turns: int = 3):
  """Token ids and gen_mask of a trajectory: prompt, then (generated, observation) turns."""
  length = max(int(length), 4)
  tokens = rng.integers(1, vocab, size=length)
  gen = np.zeros(length, np.int64)
  prompt = max(1, int(length * prompt_frac))
  bounds = np.linspace(prompt, length, turns + 1).astype(int)
  for a, b in zip(bounds[:-1], bounds[1:]):
    g = max(1, int((b - a) * 0.6))   # generated part of the turn, then its observation
    gen[a:a + g] = 1
  return tokens.tolist(), gen.tolist()


def worked_example_trees(vocab: int = 64, seed: int = 0, lengths: Sequence[int] = (9, 7, 6, 8, 5)
                         ) -> list[TreeRecord]:
  """RAO_SPEC's worked example: lambda = 0.5, K = 2; tree 1 = r1(a(a1), b), tree 2 = r2.

  Node order (flat): r1, a, b, a1, r2. Token sequences are random with the given lengths.
  """
  rng = np.random.default_rng(seed)
  traj = [random_trajectory(rng, n, vocab, turns=2) for n in lengths]
  t1 = make_tree("t1", "g", [
      make_node("r1", None, 0, ["a", "b"], 1.0, "verifier", *traj[0]),
      make_node("a", "r1", 1, ["a1"], 1.0, "verifier", *traj[1]),
      make_node("b", "r1", 1, [], 0.0, "judge", *traj[2]),
      make_node("a1", "a", 2, [], 1.0, "verifier", *traj[3]),
  ])
  t2 = make_tree("t2", "g", [make_node("r2", None, 0, [], 0.0, "verifier", *traj[4])])
  return [t1, t2]


def synthetic_trees(num_groups: int, group_size: int, vocab: int, seed: int = 0,
                    max_len: int = 1024, mean_len: int = 300, max_children: int = 3,
                    max_depth: int = 3) -> list[TreeRecord]:
  """Random recursive trees with runtime-like node lengths (log-normal, clipped to max_len)."""
  rng = np.random.default_rng(seed)
  trees = []
  for g in range(num_groups):
    for k in range(group_size):
      nodes: list[NodeRecord] = []

      def grow(node_id, parent, depth):
        n_kids = 0 if depth >= max_depth else int(rng.integers(0, max_children + 1))
        kids = [f"{node_id}.{i + 1}" for i in range(n_kids)]
        length = int(np.clip(rng.lognormal(np.log(mean_len), 0.6), 16, max_len))
        toks, gen = random_trajectory(rng, length, vocab, turns=int(rng.integers(1, 5)))
        lp = [float(-rng.exponential(1.0)) if m else 0.0 for m in gen]
        success = float(rng.random() < 0.5) if (depth == 0 or rng.random() < 0.7) else None
        source = None if success is None else ("verifier" if rng.random() < 0.8 else "judge")
        node = make_node(node_id, parent, depth, kids, success, source, toks, gen, lp)
        nodes.append(node)
        for c in kids:
          grow(c, node_id, depth + 1)

      grow("0", None, 0)
      trees.append(make_tree(f"g{g}k{k}", f"g{g}", nodes))
  return trees


def tiny_model_config(**overrides):
  """A tiny float32 Llama config (V = 64, untied head) for fast learner tests."""
  from rao_jax.model.config import ModelConfig
  base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              mlp_dim=64, param_dtype="float32", dtype="float32", tie_embeddings=False)
  base.update(overrides)
  return ModelConfig(**base)


def init_params(model_cfg, seed: int):
  """Random nnx.Param state for `model_cfg`, drawn with numpy (no compilation).

  Compiling the model's jax.random initializers takes tens of seconds on a small CPU; tests only
  need some well-scaled weights: N(0, 1/fan_in) matrices, N(1, 0.1) norm scales, zero biases.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rao_jax.model.transformer import Transformer
  rng = np.random.default_rng(seed)
  abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))),
                       nnx.Param)[1]

  def draw(path, x):
    name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
    if name.endswith("norm"):
      v = 1.0 + 0.1 * rng.standard_normal(x.shape)
    elif name in ("bq", "bk", "bv", "bo"):
      v = np.zeros(x.shape)
    else:
      fan_in = {"wo": model_cfg.n_heads * model_cfg.head_dim,
                "w_down": model_cfg.mlp_dim}.get(name, model_cfg.d_model)
      v = rng.standard_normal(x.shape) / np.sqrt(fan_in)
    return jnp.asarray(v, x.dtype)
  return jax.tree_util.tree_map_with_path(draw, abstract)
