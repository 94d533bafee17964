"""A micro-environment and a tiny policy that RAO measurably improves in about a minute on a CPU.

The task: the goal names a digit ("Finish with 3."); the agent must write the cell
`finish("3")`. The verifier checks the final message. The tokenizer (a byte-level BPE trained
on the environment's own text with the `tokenizers` library) has one token per answer cell,
```python\\nfinish("3")\\n```, so with `agent.max_new_tokens = 1` a turn is exactly one generated
token and the whole learning signal sits on it: a loss mask shifted by one token in either
direction misses it, a flipped advantage sign unlearns it, an engine that keeps its old
weights never samples a better one. That is what makes the micro-run a sharp test of the
loop (`tests/test_learns.py`), while every stage is the real one: chat template, embedded
engine, sandboxed REPL, verifier, rewards, packing, the jitted learner step, weight sync.

The policy (`build_policy`) is a tiny Llama-family model given a short supervised warm start
on scripted demonstrations, stopped early: it has learnt the format (one answer cell) but
copies the digit only partly (about 40% success with four answers, 25% by chance),
which leaves RL both a signal (groups with mixed outcomes) and room to improve.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from rao_jax.envs import base

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_TOOL_DOCS = """\
Tools: none besides finish. Answer with the digit the task names, as a string.
"""
_GOAL = "Finish with {digit}."
_GOAL_RE = re.compile(r"Finish with (\d)\.")


def answer_cell(digit: str) -> str:
  """The code cell that solves the task of `digit` (one token of the micro tokenizer)."""
  return f'```python\nfinish("{digit}")\n```'


@dataclasses.dataclass(frozen=True)
class MicroConfig:
  """Tasks of the micro-environment.

  Attributes:
    num_answers: the digits 0 .. num_answers - 1 are the possible answers (2 to 10).
    num_train: tasks in the "train" split.
    num_test: tasks in the "test" split (drawn with another seed).
    seed: base seed of the task draws.
  """
  num_answers: int = 4
  num_train: int = 64
  num_test: int = 16
  seed: int = 0

  def __post_init__(self):
    if not 2 <= self.num_answers <= 10:
      raise ValueError(f"MicroConfig.num_answers={self.num_answers}: must be in [2, 10] (the "
                       "answers are single digits).")
    for name in ("num_train", "num_test"):
      if getattr(self, name) < 1:
        raise ValueError(f"MicroConfig.{name}={getattr(self, name)}: must be >= 1.")

  @property
  def digits(self) -> tuple[str, ...]:
    return tuple(str(d) for d in range(self.num_answers))


class MicroEnv(base.Environment):
  """Finish with the digit the goal names; one exact verifier, no tools, no recursion."""

  name = "micro"

  def __init__(self, **kw):
    self.cfg = MicroConfig(**kw)
    self._tasks: dict[str, list[base.Task]] = {}

  def tasks(self, split: str = "train") -> Sequence[base.Task]:
    if split not in ("train", "test"):
      raise ValueError(f"MicroEnv has the splits 'train' and 'test', not {split!r}.")
    if split not in self._tasks:
      n = self.cfg.num_train if split == "train" else self.cfg.num_test
      rng = np.random.default_rng([self.cfg.seed, 0 if split == "train" else 1])
      digits = rng.integers(0, self.cfg.num_answers, size=n)
      self._tasks[split] = [
          base.Task(task_id=f"micro.{split}.{i}", env=self.name, goal=_GOAL.format(digit=d),
                    fields={"answer": str(d)}, max_steps=1)
          for i, d in enumerate(digits)]
    return self._tasks[split]

  def tool_docs(self, recursive: bool) -> str:
    return _TOOL_DOCS

  def new_episode(self, task: base.Task) -> base.Episode:
    return base.Episode(task)

  def node_tools(self, episode: base.Episode, node: base.NodeInfo) -> dict[str, base.Tool]:
    return {}

  def child_spec(self, episode: base.Episode, parent: base.NodeInfo, args: tuple,
                 kwargs: dict) -> base.ChildSpec:
    raise base.SubagentArgError("the micro-environment has no subtasks; answer directly.")

  def verify_root(self, episode: base.Episode, outcome: base.NodeOutcome) -> float:
    answer = str(episode.task.fields["answer"])
    return float(outcome.finished and outcome.final_message.strip() == answer)


# -- the tokenizer ---------------------------------------------------------------------------


def _corpus(cfg: MicroConfig) -> list[str]:
  """Texts the BPE is trained on: what the policy will read (prompts, goals, observations)."""
  from rao_jax.agent import prompts  # pylint: disable=g-import-not-at-top
  texts = []
  for steps in (1, 2, 4):
    for ctx in (256, 512, 1024):
      texts.append(prompts.system_prompt(_TOOL_DOCS, False, 0, 0, steps, steps, ctx))
  texts += [_GOAL.format(digit=d) for d in range(10)] + ["system", "user", "assistant"]
  texts += [prompts.observation_text("", prompts.NO_CODE, 0, 4000),
            prompts.observation_text("Finished. Your final message was recorded.", None, 0, 4000)]
  return texts * 4


def build_tokenizer(cfg: MicroConfig = MicroConfig(), vocab_size: int = 384):
  """A byte-level BPE over the environment's texts, ChatML special tokens and answer cells.

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
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tk.train_from_iterator(_corpus(cfg), trainer)
  # One token per answer cell: a turn is then exactly one decision (see the module docstring).
  tk.add_tokens([AddedToken(answer_cell(str(d)), normalized=False, special=False)
                 for d in range(10)])
  hf = PreTrainedTokenizerFast(
      tokenizer_object=tk, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
      unk_token=None, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
      model_max_length=int(1e9))
  return Tokenizer(hf)


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


def _demonstrator(prompt: str, num_tokens: int) -> str:
  """The scripted policy: the answer cell of the digit the prompt's goal names."""
  del num_tokens
  goals = _GOAL_RE.findall(prompt)
  return answer_cell(goals[-1] if goals else "0")


def policy_success(model, tokenizer, runner_cfg, env: MicroEnv, tasks) -> float:
  """The policy's expected success at temperature 1: the mean probability of the right cell.

  Exact (no sampling), so warm starts can be checked against the learnable range cheaply.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import chat, prompts  # pylint: disable=g-import-not-at-top
  fmt = chat.ChatFormat(tokenizer)
  rows, cells = [], []
  for task in tasks:
    steps = min(runner_cfg.max_steps_per_agent, task.max_steps)
    system = prompts.system_prompt(env.tool_docs(False), False, 0, runner_cfg.max_depth, steps,
                                   task.max_steps, runner_cfg.context_window)
    rows.append(fmt.prompt_ids(system, task.goal))
    cells.append(tokenizer.encode(answer_cell(task.fields["answer"]))[0])
  T = max(len(r) for r in rows)
  # Right-aligned in one batch: each row's last position is its generation position.
  tokens_BxT = np.zeros((len(rows), T), np.int32)
  segments_BxT = np.zeros((len(rows), T), np.int32)
  positions_BxT = np.zeros((len(rows), T), np.int32)
  for b, r in enumerate(rows):
    tokens_BxT[b, T - len(r):] = r
    segments_BxT[b, T - len(r):] = 1
    positions_BxT[b, T - len(r):] = np.arange(len(r))
  hidden_BxTxD = model(jnp.asarray(tokens_BxT), jnp.asarray(positions_BxT),
                       jnp.asarray(segments_BxT))
  p_BxV = jax.nn.softmax(model.logits(hidden_BxTxD[:, -1:])[:, 0])
  probs = np.asarray(p_BxV)[np.arange(len(rows)), cells]
  return float(np.mean(probs))


def build_policy(out_dir: str, runner_cfg, env_kwargs: dict[str, Any] | None = None, *,
                 seed: int = 0, target_success: float = 0.4, max_steps: int = 64,
                 check_every: int = 4, demos_per_step: int = 16,
                 lr: float = 3e-3) -> dict[str, Any]:
  """Builds the micro policy as an HF folder `out_dir` (config, safetensors, tokenizer).

  A random tiny model (`model_config`) is trained with supervised steps on demonstration trees
  grown by the real runtime (chat format, REPL, `finish`) with a scripted demonstrator that
  always answers right, and stopped as soon as its expected success (`policy_success`, checked
  every `check_every` steps) reaches `target_success`: the copying circuit forms at a
  seed-dependent step (20-40 here), and stopping on the measured success rather than after a
  fixed count starts every seed at the same place.

  Args:
    out_dir: the folder to write (`config.model.name` of the run).
    runner_cfg: the run's `RunnerConfig` (the demonstrations' prompts must be the run's).
    env_kwargs: `MicroConfig` fields (the run's `config.env.kwargs`).
    seed: parameter init and demonstration task draw.
    target_success: expected train success at which the warm start stops.
    max_steps: most supervised steps (raises if the target is not reached by then).
    check_every: supervised steps between two measurements of the success.
    demos_per_step: demonstration trees per step.
    lr: supervised learning rate.

  Returns:
    {"dir", "success": expected train success at temperature 1, "steps", "nll", "seconds"}.

  Raises:
    RuntimeError: the target was not reached within `max_steps`.
  """
  import time  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rao_jax.agent import local_exec, policies, runner as runner_lib  # pylint: disable=g-import-not-at-top
  from rao_jax.learner import Learner, LearnerConfig, pack_trees  # pylint: disable=g-import-not-at-top
  from rao_jax.model import sharding  # pylint: disable=g-import-not-at-top
  from rao_jax.model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from rao_jax.model.weights import export_hf  # pylint: disable=g-import-not-at-top
  from rao_jax.sft import sft_advantages  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  env = MicroEnv(**dict(env_kwargs or {}))
  tokenizer = build_tokenizer(env.cfg)
  mcfg = model_config(tokenizer.vocab_size, tokenizer)
  model = Transformer(mcfg, rngs=nnx.Rngs(seed))

  engine = policies.ScriptedTurnEngine(tokenizer, _demonstrator)
  runner = runner_lib.TreeRunner(env, engine, tokenizer, local_exec.LocalReplPool(),
                                 dataclasses.replace(runner_cfg, temperature=0.0, top_p=1.0))
  rng = np.random.default_rng([seed, 1])
  train = list(env.tasks("train"))
  picks = rng.choice(len(train), size=max_steps * demos_per_step)
  trees = asyncio.run(runner.run_tasks([train[i] for i in picks]))

  row_len = runner_cfg.context_window
  lcfg = LearnerConfig(loss="rao", lr=lr, total_steps=max_steps, row_len=row_len,
                       micro_batch_rows=demos_per_step, bucket_rows=(demos_per_step,),
                       seed=seed, ckpt_dir="")
  learner = Learner(lcfg, mcfg, mesh=sharding.make_mesh(1, 1, 1), params=model)
  nll, success, step = float("nan"), 0.0, 0
  try:
    while success < target_success:
      if step >= max_steps:
        raise RuntimeError(f"build_policy: the warm start reached success {success:.3f} < "
                           f"target_success={target_success} in max_steps={max_steps}; raise "
                           "max_steps or lr.")
      chunk = trees[step * demos_per_step:(step + 1) * demos_per_step]
      batch = pack_trees(chunk, sft_advantages(chunk), row_len, lcfg.bucket_rows, loss="rao")
      nll = learner.step(batch)["loss"]
      step += 1
      if step % check_every == 0:
        success = policy_success(learner.model, tokenizer, runner_cfg, env, train)
    export_hf(learner.model, mcfg, tokenizer, out_dir)
  finally:
    learner.close()
  info = {"dir": out_dir, "success": success, "steps": step, "nll": nll,
          "seconds": time.perf_counter() - t0}
  with open(os.path.join(out_dir, "warm_start.json"), "w") as f:
    json.dump(info, f, indent=2)
  return info
