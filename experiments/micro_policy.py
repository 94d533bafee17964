"""Tiny policies for the micro-environments: a BPE tokenizer, a 2-layer model, a warm start.

Both micro-environments (`rao_jax/envs/micro.py`: answer the digit; `rao_jax/envs/delegation.py`:
k-part tasks that need helpers) make every turn one generated token: the tokenizer has one
token per answer cell, so a turn is one decision and the whole learning signal sits on it.

`build_policy` gives a random tiny model a short supervised warm start on demonstration trees
that the real runtime grows with a scripted policy (chat format, REPL, `finish`,
`launch_subagent`), and stops it as soon as a measured property of the policy reaches its
target (exact probabilities under the model, no sampling): it has learnt the format but not
the task, which leaves RL both a signal and room. The result is an HF folder (config,
safetensors, tokenizer) that any run opens as `config.model.name`.

This is experiment code (it trains a model), so it lives above the library: the environments
only define tasks, tools and verifiers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Sequence

import numpy as np

from rao_jax.agent import chat, local_exec, policies, prompts, runner as runner_lib
from rao_jax.envs import base, delegation, delegation_deep, micro

_USER_RE = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


# -- the tokenizer ---------------------------------------------------------------------------


def _system_prompts(env: base.Environment, max_depth: int,
                    budgets: Sequence[int] = (1, 2, 4)) -> list[str]:
  """System prompts the runtime may show (both modes, every depth, a few limits)."""
  texts = []
  for recursive in (False, True):
    for depth in range(max_depth + 1):
      for steps in budgets:
        for ctx in (256, 512, 1024):
          texts.append(prompts.system_prompt(env.tool_docs(recursive), recursive, depth,
                                             max_depth, min(steps, 4), steps, ctx))
  return texts


def _deep_budgets() -> list[int]:
  """Every step budget a node of the deep environment can hold (a perfect tree's and less)."""
  out = set()
  for k in delegation_deep.SIZES:
    b = delegation_deep.tree_budget(k)
    while b >= 1:
      out.update({b, b - 2})   # a second helper may get less than the first when starved
      b = delegation_deep.helper_budget(b)
  return sorted(x for x in out if x >= 1)


def build_tokenizer(texts: Sequence[str], cells: Sequence[str], vocab_size: int = 384):
  """A byte-level BPE over `texts`, ChatML special tokens, and one token per cell of `cells`.

  Returns:
    a rao_jax `Tokenizer` (over a transformers `PreTrainedTokenizerFast`).
  """
  from tokenizers import AddedToken, Tokenizer as TkTokenizer  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  from rao_jax.model.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  tk = TkTokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(micro.SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tk.train_from_iterator(list(texts) * 4, trainer)
  # One token per cell: a turn is then exactly one decision.
  tk.add_tokens([AddedToken(c, normalized=False, special=False) for c in cells])
  hf = PreTrainedTokenizerFast(
      tokenizer_object=tk, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
      unk_token=None, chat_template=micro.CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
      model_max_length=int(1e9))
  return Tokenizer(hf)


def tokenizer_for(env: base.Environment):
  """The micro tokenizer of `env` (a `MicroEnv`, `DelegationEnv` or `DeepDelegationEnv`)."""
  common = ["system", "user", "assistant",
            prompts.observation_text("", prompts.NO_CODE, 0, 4000),
            prompts.observation_text("Finished. Your final message was recorded.", None, 0, 4000)]
  if isinstance(env, delegation_deep.DeepDelegationEnv):
    # Depths up to 8 (the deep config's max_depth) and every budget a node can hold.
    return build_tokenizer(_system_prompts(env, 8, _deep_budgets())
                           + delegation_deep.corpus_texts(env.cfg) + common,
                           delegation_deep.CELLS, vocab_size=1024)
  if isinstance(env, delegation.DelegationEnv):
    # BPE merges stop at word boundaries: 1,024 is past the ~610 merges this text allows, and
    # halves a prompt against 384 (~250 tokens), which halves every run's tokens.
    return build_tokenizer(_system_prompts(env, 1) + delegation.corpus_texts(env.cfg) + common,
                           delegation.CELLS, vocab_size=1024)
  if isinstance(env, micro.MicroEnv):
    texts = [prompts.system_prompt(env.tool_docs(False), False, 0, 0, s, s, ctx)
             for s in (1, 2, 4) for ctx in (256, 512, 1024)]
    texts += [micro.task_goal(str(d)) for d in range(10)]
    return build_tokenizer(texts + common, [micro.answer_cell(str(d)) for d in range(10)])
  raise ValueError(f"tokenizer_for: no micro tokenizer for environment {env.name!r}; use the "
                   "'micro', 'delegation' or 'delegation_deep' environment.")


# -- the policy --------------------------------------------------------------------------------


def model_config(vocab_size: int, tokenizer=None):
  """The tiny Llama-family policy: 2 layers, D=64, 4 query / 2 kv heads of 16, F=128."""
  from rao_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  ids = {}
  if tokenizer is not None:
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
  return ModelConfig(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, mlp_dim=128, max_seq_len=2048, tie_embeddings=True,
                     param_dtype="float32", dtype="float32", **ids)


def user_goal(prompt_text: str) -> str:
  """The last user message of a ChatML prompt: the node's goal."""
  found = _USER_RE.findall(prompt_text)
  return found[-1].strip() if found else ""


def node_prompts(trees) -> list[tuple[list[int], Any]]:
  """(prompt ids, node record) of every node that generated: what the policy saw first."""
  out = []
  for t in trees:
    for n in t.nodes:
      if n.turn_starts:
        out.append((list(n.token_ids[:n.turn_starts[0]]), n))
  return out


def cell_probs(model, rows: Sequence[Sequence[int]], cell_ids: Sequence[int],
               with_top: bool = False):
  """P(first generated token = cell_ids[b] | rows[b]) at temperature 1, exactly; with
  `with_top`, also whether cell_ids[b] is the most likely token (what greedy decoding emits)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  T = max(len(r) for r in rows)
  # Right-aligned in one batch: each row's last position is its generation position.
  tokens_BxT = np.zeros((len(rows), T), np.int32)
  segments_BxT = np.zeros((len(rows), T), np.int32)
  positions_BxT = np.zeros((len(rows), T), np.int32)
  for b, r in enumerate(rows):
    tokens_BxT[b, T - len(r):] = r
    segments_BxT[b, T - len(r):] = 1
    positions_BxT[b, T - len(r):] = np.arange(len(r))
  p_BxV = np.asarray(_last_probs(model, jnp.asarray(tokens_BxT), jnp.asarray(positions_BxT),
                                 jnp.asarray(segments_BxT)))
  p_B = p_BxV[np.arange(len(rows)), np.asarray(cell_ids)]
  return (p_B, p_BxV.argmax(-1) == np.asarray(cell_ids)) if with_top else p_B


def _last_probs(model, tokens_BxT, positions_BxT, segments_BxT):
  """softmax of the last position's logits, jitted once per shape (the warm start probes the
  same rows every few steps; eagerly, each probe cost as much as four supervised steps)."""
  global _LAST_PROBS
  if _LAST_PROBS is None:
    import jax  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top

    @nnx.jit
    def fn(model, tokens_BxT, positions_BxT, segments_BxT):
      hidden_BxTxD = model(tokens_BxT, positions_BxT, segments_BxT)
      return jax.nn.softmax(model.logits(hidden_BxTxD[:, -1:])[:, 0])
    _LAST_PROBS = fn
  return _LAST_PROBS(model, tokens_BxT, positions_BxT, segments_BxT)


_LAST_PROBS = None


def grow_trees(env, tokenizer, runner_cfg, tasks, turn_fn: Callable[[str, int], str]):
  """Trees the real runtime grows on `tasks` with the scripted `turn_fn` (local REPLs)."""
  engine = policies.ScriptedTurnEngine(tokenizer, turn_fn)
  runner = runner_lib.TreeRunner(env, engine, tokenizer, local_exec.LocalReplPool(),
                                 dataclasses.replace(runner_cfg, temperature=0.0, top_p=1.0))
  return asyncio.run(runner.run_tasks(list(tasks)))


class Probe:
  """What the warm start measures on the train tasks, and when it is done.

  `measure(model) -> dict[str, float]` (exact probabilities); `done(measured) -> bool`.
  """

  def __init__(self, env, tokenizer, runner_cfg, target: dict[str, float]):
    self.env, self.tokenizer, self.target = env, tokenizer, dict(target)
    tasks = list(env.tasks("train"))
    self.deep = isinstance(env, delegation_deep.DeepDelegationEnv)
    if self.deep:
      # The best recursive policy's trees: every node's real prompt, and its right cell.
      trees = grow_trees(env, tokenizer, runner_cfg, tasks,
                         lambda text, n: delegation_deep.best_cell(user_goal(text)))
    elif isinstance(env, delegation.DelegationEnv):
      # Every root delegates in the probe's trees: the roots' and the helpers' real prompts.
      trees = grow_trees(env, tokenizer, runner_cfg, tasks,
                         lambda text, n: delegation.demonstration(
                             user_goal(text), np.random.default_rng(0), 1.0))
    else:
      trees = grow_trees(env, tokenizer, runner_cfg, tasks,
                         lambda text, n: micro.answer_cell(micro.goal_digit(user_goal(text))))
    self.rows, self.cells, self.depths, self.trees = [], [], [], []
    enc = lambda cell: tokenizer.encode(cell)[0]
    for k, t in enumerate(trees):
      for ids, n in node_prompts([t]):
        self.rows.append(ids)
        self.depths.append(n.depth)
        self.trees.append(k)
        if self.deep:
          self.cells.append(enc(delegation_deep.best_cell(n.goal)))
        elif n.depth == 0 and isinstance(env, delegation.DelegationEnv):
          self.cells.append(enc(delegation.DELEGATE_CELL))
        else:
          self.cells.append(enc(micro.answer_cell(str(n.task_fields["answer"]))))
    self.depths, self.trees = np.asarray(self.depths), np.asarray(self.trees)
    if self.deep:
      self.split_N = np.asarray(self.cells) == enc(delegation_deep.SPLIT_CELL)

  def measure(self, model) -> dict[str, float]:
    p, top = cell_probs(model, self.rows, self.cells, with_top=True)
    if self.deep:
      # Splitting nodes (several items) and answering ones (one item): the two decisions.
      split = self.split_N
      succ = [np.prod(p[self.trees == k]) for k in np.unique(self.trees)]
      # child_greedy: the one-item nodes whose right cell is the most likely token. A mean
      # p(right) of 0.4 is also reached by a model that learnt one digit well and sends the
      # others to a wrong cell (no copying), which greedy decoding then answers wrongly: which
      # of the two a build stopped at depended on the tokenizer's numbering (a reworded prompt
      # the deep task never shows took held-out greedy success from 1.00 to 0.25).
      return {"delegate": float(p[split].mean()), "child_right": float(p[~split].mean()),
              "child_greedy": float(top[~split].mean()), "success": float(np.mean(succ))}
    if not isinstance(self.env, delegation.DelegationEnv):
      return {"success": float(p.mean())}
    roots = self.depths == 0
    # A root succeeds when it delegates and every helper answers right.
    succ = [p[(self.trees == k) & roots][0] * np.prod(p[(self.trees == k) & ~roots])
            for k in np.unique(self.trees)]
    return {"delegate": float(p[roots].mean()), "child_right": float(p[~roots].mean()),
            "success": float(np.mean(succ))}

  def done(self, measured: dict[str, float]) -> bool:
    return all(measured.get(k, 0.0) >= v for k, v in self.target.items())


def default_target(env: base.Environment) -> dict[str, float]:
  """What the warm start's probe must measure before its supervised training stops: on the
  delegation tasks a helper's chance of the right answer; on the deep task also that the right
  answer is the greedy one on 95% of one-item nodes (see `Probe.measure`)."""
  if isinstance(env, delegation_deep.DeepDelegationEnv):
    return {"child_right": 0.4, "child_greedy": 0.95}
  if isinstance(env, delegation.DelegationEnv):
    return {"child_right": 0.4}
  return {"success": 0.4}


def build_policy(out_dir: str, runner_cfg, env, *, seed: int = 0,
                 target: dict[str, float] | None = None, p_delegate: float = 0.5,
                 p_extra: float = 0.1, max_steps: int = 96, check_every: int = 4, demos_per_step: int = 16,
                 lr: float = 3e-3) -> dict[str, Any]:
  """Builds the micro policy of `env` as an HF folder `out_dir` (config, safetensors, tokenizer).

  A random tiny model (`model_config`) is trained with supervised steps on demonstration trees
  grown by the real runtime with a scripted demonstrator, and stopped as soon as every
  measured quantity reaches `target` (checked every `check_every` steps): the copying circuit
  forms at a seed-dependent step, and stopping on the measurement rather than after a fixed
  count starts every seed at the same place.

  Demonstrators: micro: the right answer cell. Delegation: a helper answers its digit; a root
  delegates with probability `p_delegate`, else answers the first digit (the single agent's
  best move), so the warm start delegates only part of the time. Deep delegation
  (`delegation_deep.demonstration`): a node of several items splits with probability
  `p_delegate`, else answers its first item; any node echoes its goal to two helpers with
  probability `p_extra`, and a one-item node forwards it to one helper with `p_extra`.

  Args:
    out_dir: the folder to write (`config.model.name` of the run).
    runner_cfg: the run's `RunnerConfig` (the demonstrations' prompts must be the run's).
    env: the run's environment (`MicroEnv` or `DelegationEnv`).
    seed: parameter init and demonstration draws.
    target: {measured quantity: value to reach}; default {"success": 0.4} for micro and
      {"child_right": 0.4} for delegation (see `Probe.measure` for the names).
    p_delegate: the delegation demonstrator's share of roots that delegate.
    p_extra: deep delegation: the demonstrator's share of helpers beyond what a split needs.
    max_steps: most supervised steps (raises if the target is not reached by then).
    check_every: supervised steps between two measurements.
    demos_per_step: demonstration trees per step.
    lr: supervised learning rate.

  Returns:
    {"dir", "measured": the last measurement, "success", "steps", "nll", "seconds"}.

  Raises:
    RuntimeError: the target was not reached within `max_steps`.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax import sft  # pylint: disable=g-import-not-at-top
  from rao_jax.learner import Learner, LearnerConfig, pack_trees  # pylint: disable=g-import-not-at-top
  from rao_jax.model import sharding  # pylint: disable=g-import-not-at-top
  from rao_jax.model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from rao_jax.model.weights import export_hf  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  is_deep = isinstance(env, delegation_deep.DeepDelegationEnv)
  is_delegation = isinstance(env, delegation.DelegationEnv)
  target = target or default_target(env)
  tokenizer = tokenizer_for(env)
  mcfg = model_config(tokenizer.vocab_size, tokenizer)
  model = Transformer(mcfg, rngs=nnx.Rngs(seed))
  probe = Probe(env, tokenizer, runner_cfg, target)

  rng = np.random.default_rng([seed, 1])
  train = list(env.tasks("train"))
  picks = rng.choice(len(train), size=max_steps * demos_per_step)
  demo_rng = np.random.default_rng([seed, 2])
  if is_deep:
    turn = lambda text, n: delegation_deep.demonstration(user_goal(text), demo_rng, p_delegate,
                                                         p_extra)
  elif is_delegation:
    turn = lambda text, n: delegation.demonstration(user_goal(text), demo_rng, p_delegate)
  else:
    turn = lambda text, n: micro.answer_cell(micro.goal_digit(user_goal(text)))

  row_len = runner_cfg.context_window
  # Up to 1 + k nodes a tree: rows for the largest step, one bucket (one compilation).
  if is_deep:
    # A ladder: a step's batch costs what its bucket holds, and deep demonstrations average
    # ~5 nodes a tree against a largest possible 46.
    buckets = tuple(demos_per_step * m for m in (4, 8, 16, delegation_deep.tree_budget(
        max(env.cfg.sizes))))
  else:
    buckets = (demos_per_step * (1 + (env.cfg.num_parts if is_delegation else 0)),)
  lcfg = LearnerConfig(loss="rao", lr=lr, total_steps=max_steps, row_len=row_len,
                       micro_batch_rows=demos_per_step, bucket_rows=buckets, seed=seed,
                       ckpt_dir="")
  learner = Learner(lcfg, mcfg, mesh=sharding.make_mesh(1, 1, 1), params=model)
  nll, measured, step = float("nan"), {}, 0
  try:
    while not probe.done(measured):
      if step >= max_steps:
        raise RuntimeError(f"build_policy: the warm start measured {measured} short of "
                           f"target={target} in max_steps={max_steps}; raise max_steps or lr.")
      if step % check_every == 0:   # the demonstrations of the next measured block
        block = picks[step * demos_per_step:(step + check_every) * demos_per_step]
        trees = grow_trees(env, tokenizer, runner_cfg, [train[i] for i in block], turn)
      k = step % check_every
      chunk = trees[k * demos_per_step:(k + 1) * demos_per_step]
      batch = pack_trees(chunk, sft.sft_advantages(chunk), row_len, lcfg.bucket_rows, loss="rao")
      nll = learner.step(batch)["loss"]
      step += 1
      if step % check_every == 0:
        measured = probe.measure(learner.model)
    export_hf(learner.model, mcfg, tokenizer, out_dir)
  finally:
    learner.close()
  info = {"dir": out_dir, "measured": measured, "success": measured.get("success", 0.0),
          "steps": step, "nll": nll, "seconds": time.perf_counter() - t0}
  with open(os.path.join(out_dir, "warm_start.json"), "w") as f:
    json.dump(info, f, indent=2)
  return info
