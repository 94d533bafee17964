"""Experiment configs: every file and variant builds, locks, and rejects bad values clearly."""
import json
import os

import pytest
from ml_collections import config_flags  # noqa: F401  (the flag machinery users go through)

from experiments.configs import base, longcontext, search, textcraft, textcraft_synth
from rao_jax import experiment as X


@pytest.mark.parametrize("mod,arg", [
    (textcraft_synth, "recursive,ctx=8192"), (textcraft_synth, "single,ctx=4096,train=hard"),
    (textcraft_synth, "recursive,ctx=40960"), (textcraft_synth, "recursive,smoke"),
    (textcraft_synth, "recursive,demo"), (textcraft, "single,smoke"), (textcraft, "recursive"),
    (longcontext, "recursive,ctx=32768,doc=175000"), (longcontext, "single,smoke"),
    (search, "recursive,hops=4"), (search, "single,smoke"),
])
def test_every_variant_builds_and_translates(mod, arg):
  c = mod.get_config(arg)
  c.lock()
  assert c.agent.mode == ("single" if "single" in arg else "recursive")
  rc = X.runner_config(c)
  assert rc.recursive == (c.agent.mode == "recursive")
  assert rc.context_window == c.agent.context_window
  lc = X.learner_config(c, "/tmp/unused")
  assert lc.row_len == c.agent.context_window and lc.loss == c.rl.loss
  with pytest.raises(AttributeError):
    c.agent.not_a_field = 1   # locked: typos in overrides fail loudly


def test_paper_grid_rejects_unknown_context():
  with pytest.raises(ValueError, match="ctx=1234"):
    textcraft_synth.get_config("recursive,ctx=1234")


def test_parse_arg():
  assert base.parse_arg("recursive, ctx=8192,smoke") == {"recursive": "1", "ctx": "8192",
                                                        "smoke": "1"}
  assert base.parse_arg(None) == {}


def test_group_size_one_is_a_configuration_error():
  c = textcraft_synth.get_config("recursive,smoke")
  c.rl.group_size = 1
  with pytest.raises(ValueError, match="group_size=1.*K >= 2"):
    X.rl_config(c)


def test_overlap_needs_a_ratio_loss():
  c = textcraft_synth.get_config("recursive,smoke")
  c.rl.overlap = True
  with pytest.raises(ValueError, match="ppo_clip or cispo"):
    X.rl_config(c)
  c.rl.loss = "ppo_clip"
  assert X.rl_config(c).overlap is True
  with pytest.raises(ValueError, match="overlap=True with several processes"):
    X.rl_config(c).check_processes(2)
  X.rl_config(c).check_processes(1)


def test_rl_config_is_typed_frozen_and_names_key_value_and_fix():
  c = textcraft_synth.get_config("recursive,smoke")
  rl = X.rl_config(c)
  assert (rl.total_steps, rl.group_size, rl.tasks_per_step) == (c.total_steps, c.rl.group_size,
                                                               c.rl.tasks_per_step)
  assert rl.deadline_s is None and isinstance(rl.rollout_deadline_s, float)
  with pytest.raises(Exception, match="cannot assign"):
    rl.group_size = 3
  assert X.RLConfig(total_steps=1, rollout_deadline_s=30).deadline_s == 30.0
  bad = [
      (dict(group_size=4.0), r"config.rl.group_size=4.0 must be an integer >= 2"),
      (dict(group_size=True), r"config.rl.group_size=True must be an integer"),
      (dict(total_steps=-1), r"config.total_steps=-1: must be >= 0"),
      (dict(tasks_per_step=0), r"config.rl.tasks_per_step=0: must be >= 1 \(root tasks"),
      (dict(max_nonfinite_steps=0), r"config.rl.max_nonfinite_steps=0: must be >= 1"),
      (dict(infra_retries=-1), r"config.rl.infra_retries=-1: must be >= 0"),
      (dict(max_staleness="1"), r"config.rl.max_staleness='1' must be an integer"),
      (dict(overlap="yes"), r"config.rl.overlap='yes': use True or False"),
      (dict(rollout_deadline_s=-5), r"config.rl.rollout_deadline_s=-5: use a number of seconds"),
      (dict(rollout_deadline_s="soon"), r"rollout_deadline_s='soon'"),
      (dict(deadline_rule="wait"), r"config.rl.deadline_rule='wait': use one of"),
  ]
  for kw, msg in bad:
    with pytest.raises(ValueError, match=msg):
      X.RLConfig(**{"total_steps": 2, **kw})


def test_bad_names_give_clear_errors():
  c = textcraft_synth.get_config("recursive,smoke")
  c.env.name = "minecraft"
  with pytest.raises(ValueError, match="Unknown environment 'minecraft'"):
    X.make_env(c)
  c = textcraft_synth.get_config("recursive,smoke")
  c.agent.mode = "swarm"
  with pytest.raises(ValueError, match="agent.mode='swarm'"):
    X.runner_config(c)
  with pytest.raises(ValueError, match="learner.mesh"):
    X.make_mesh("data=two")


def test_micro_batches_hold_whole_rows_on_every_device_of_an_explicit_mesh(tmp_path):
  import jax
  c = textcraft_synth.get_config("recursive,smoke")
  c.learner.micro_batch_rows = 1
  c.learner.bucket_rows = (1, 3)
  c.learner.mesh = "data=2,fsdp=2,tensor=2"
  lcfg = X.learner_config(c, str(tmp_path))
  assert lcfg.micro_batch_rows == 4 and lcfg.bucket_rows == (4,)
  c.learner.mesh = "tensor=2"
  assert X.learner_config(c, str(tmp_path)).micro_batch_rows == 1
  c.learner.mesh = "auto"
  assert X.learner_config(c, str(tmp_path)).micro_batch_rows == jax.device_count()


def test_train_tasks_are_a_pure_function_of_seed_and_step():
  c = textcraft_synth.get_config("recursive,smoke")
  env = X.make_env(c)
  tasks = X.task_split(env, "train", "easy")
  a = [t.task_id for t in X.train_tasks_for_step(tasks, 5, 4, seed=1)]
  b = [t.task_id for t in X.train_tasks_for_step(tasks, 5, 4, seed=1)]
  other = [t.task_id for t in X.train_tasks_for_step(tasks, 6, 4, seed=1)]
  assert a == b and a != other and len(set(a)) == 4
  held_out = {t.task_id for t in X.eval_tasks(env, "easy", 10)}
  assert not held_out & {t.task_id for t in tasks}


def test_task_weights_draw_the_weighted_tasks_more_often_and_name_bad_rules():
  c = textcraft_synth.get_config("recursive,smoke")
  tasks = X.task_split(X.make_env(c), "train", "medium")
  two = {t.task_id for t in tasks if len(t.fields["target_items"]) == 2}
  assert 0 < len(two) < len(tasks)

  def share(spec):
    drawn = [t.task_id for s in range(200) for t in X.train_tasks_for_step(tasks, s, 2, 1, spec)]
    return sum(x in two for x in drawn) / len(drawn)
  uniform, weighted = share(""), share("target_items:2=4")
  assert weighted > uniform + 0.2
  assert share("target_items:1=0") == 1.0   # weight 0: never drawn
  # Pure in (seed, step), as the uniform draw: a resumed run draws the same tasks.
  assert X.train_tasks_for_step(tasks, 3, 4, 1, "target_items:2=4") == \
      X.train_tasks_for_step(tasks, 3, 4, 1, "target_items:2=4")
  # The Trainer draws with the weights assembled once from the rule: the same tasks.
  weights = X.task_weights(tasks, "target_items:2=4")
  assert all(X.train_tasks_for_step(tasks, s, 4, 1, weights)
             == X.train_tasks_for_step(tasks, s, 4, 1, "target_items:2=4") for s in range(20))
  with pytest.raises(ValueError, match="'target_items=2' is not FIELD:VALUE=WEIGHT"):
    X.RLConfig(total_steps=1, task_weights="target_items=2")
  with pytest.raises(ValueError, match="no train task has the field"):
    X.task_weights(tasks, "targets:2=3")
  with pytest.raises(ValueError, match="every train task weight 0"):
    X.task_weights(tasks, "target_items:1=0,target_items:2=0")


def test_evaluation_overrides_set_known_keys_and_name_unknown_ones():
  from rao_jax import evaluation
  c = textcraft_synth.get_config("recursive,smoke")
  evaluation.apply_overrides(c, {"agent.max_depth": 7, "env.kwargs.seed": 3})
  assert c.agent.max_depth == 7 and c.env.kwargs.seed == 3
  with pytest.raises(ValueError, match="'agent.max_dept'"):
    evaluation.apply_overrides(c, {"agent.max_dept": 7})
  with pytest.raises(ValueError, match="no 'agnt'"):
    evaluation.apply_overrides(c, {"agnt.max_depth": 7})


def test_row_shorter_than_the_context_window_is_refused():
  c = textcraft_synth.get_config("recursive,ctx=8192")
  c.learner.row_len = 2048
  with pytest.raises(ValueError, match="row_len=2048 is shorter"):
    X.learner_config(c, "/tmp/unused")


def test_sft_has_its_own_warmup_and_learning_rate():
  c = textcraft_synth.get_config("recursive,demo")
  lc = X.learner_config(c, "/tmp/unused", sft=True)
  # A two-step warm start must not spend its steps at a warm-up learning rate of 0.
  assert lc.warmup_steps == c.sft.warmup_steps == 0 and lc.lr == c.sft.lr
  assert X.learner_config(c, "/tmp/unused").warmup_steps == c.optim.warmup_steps


def test_demo_keeps_a_finished_run_and_resumes_an_unfinished_one(tmp_path):
  # Run in a subprocess: experiments.demo defines absl flags that other entry points imported
  # by this test session define too.
  import json
  import os
  import subprocess
  import sys
  root = tmp_path / "demo_out"
  call = [sys.executable, "-c",
          f"from experiments.demo import prepare_workdir; prepare_workdir({str(root)!r})"]
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def run():
    return subprocess.run(call, capture_output=True, text=True, check=True, cwd=repo).stdout

  assert run() == ""                                  # nothing there: a fresh start, silently
  (root / "sft").mkdir(parents=True)
  (root / "sft" / "ckpt").write_text("x")
  assert "Resuming the unfinished demo" in run()      # interrupted: resumed in place
  assert (root / "sft" / "ckpt").exists()
  (root / "demo_summary.json").write_text(json.dumps({"eval_success": {}}))
  out = run()
  assert "A finished demo was in" in out and "Starting a fresh one" in out
  kept = [p for p in tmp_path.iterdir() if p.name.startswith("demo_out.previous-")]
  assert len(kept) == 1 and (kept[0] / "sft" / "ckpt").read_text() == "x"   # nothing lost
  assert not root.exists()


def test_task_files_replace_a_split_through_the_config(tmp_path):
  """--config.env.task_files.test=PATH: the held-out split comes from that JSONL file."""
  from rao_jax.envs import textcraft as tc
  src = os.path.join(tc.DATA_DIR, "textcraft_train.jsonl")
  with open(src) as f:
    lines = [next(f) for _ in range(3)]
  path = tmp_path / "held_out.jsonl"
  path.write_text("".join(lines))
  c = textcraft.get_config("recursive")
  c.env.task_files.test = str(path)
  env = X.make_env(c)
  goals = [json.loads(line)["goal"] for line in lines]
  assert [t.goal for t in env.tasks("test")] == goals
  assert len(env.tasks("train")) == 900     # the other splits stay the environment's own


def test_engine_config_takes_engine_defaults_and_any_field_a_run_sets():
  from rao_jax import experiment as X
  from rao_jax.rollout.engine import EngineConfig
  c = base.base_config()
  e = X.engine_config(c)
  assert (e.num_slots, e.max_len, e.share_prefix_min) == (
      c.rollout.num_slots, c.rollout.max_cache_len, c.rollout.share_prefix_min)
  assert e.chunk_sizes == EngineConfig.chunk_sizes and e.seed == c.seed
  c.rollout.embedded.chunk_sizes = [16, 128]
  c.rollout.embedded.decode_rows = (8, 32)
  e = X.engine_config(c)
  assert e.chunk_sizes == (16, 128) and e.decode_rows == (8, 32)
  base.check_keys(c)   # the section is free-form: its keys are EngineConfig's
  c.rollout.embedded.chunk_size = 64
  with pytest.raises(ValueError, match=r"\['chunk_size'\].*valid"):
    X.engine_config(c)


def test_every_demonstration_of_the_demo_fits_its_window():
  # The demo trains on 1280-token windows (two agents a packed row): every scripted
  # demonstration it collects must succeed within that window, with room for a longer model
  # turn. Shrinking the window below a demonstrated agent drops trees (fewer than 16) or fails.
  import asyncio
  from rao_jax import sft
  from rao_jax.model.tokenizer import Tokenizer
  from rao_jax.model.weights import resolve_model_path
  c = textcraft_synth.get_config("recursive,demo")
  env = X.make_env(c)
  tokenizer = Tokenizer.from_gguf(resolve_model_path(c.model.name))

  async def collect():
    repls = X.sandbox_pool(c)
    await repls.start()
    try:
      return await sft.collect_demonstrations(c, env, tokenizer, sft.demonstration_tasks(c, env),
                                              repls)
    finally:
      await repls.close()

  trees = asyncio.run(collect())
  assert len(trees) == c.sft.num_demos == 16
  longest = max(len(n.token_ids) for t in trees for n in t.nodes)
  assert longest + c.agent.max_new_tokens <= c.agent.context_window == 1280, longest
  assert X.learner_config(c, "/tmp/unused").row_len == 1280
