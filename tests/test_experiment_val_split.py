"""The validation split of train tasks: what RL and demonstrations draw from never meets it,
and in-loop evaluation can run on it instead of the held-out tasks."""
import pytest

from experiments.configs import textcraft_synth
from rao_jax import experiment as X
from rao_jax import sft


def _config(val=8):
  c = textcraft_synth.get_config("recursive")
  c.env.kwargs.tasks_per_difficulty = 40
  c.env.val_tasks = val
  return c


def test_val_split_is_the_last_train_tasks_and_never_drawn():
  c = _config()
  env = X.make_env(c)
  every = X.task_split(env, "train", c.env.train_difficulty)
  train, val = X.train_and_val_tasks(env, c)
  assert [t.task_id for t in train + val] == [t.task_id for t in every]
  assert len(val) == 8 and not {t.task_id for t in train} & {t.task_id for t in val}
  c.sft.num_demos = 40   # asks for every task: still none of the validation split
  demos = sft.demonstration_tasks(c, env)
  assert len(demos) == 32 and not {t.task_id for t in demos} & {t.task_id for t in val}
  drawn = {t.task_id for step in range(50)
           for t in X.train_tasks_for_step(train, step, 4, seed=0)}
  assert not drawn & {t.task_id for t in val}


def test_evaluation_sets_follow_eval_split():
  c = _config()
  env = X.make_env(c)
  c.eval.num_tasks = 5
  held_out = X.evaluation_sets(env, c)
  assert [name for name, _ in held_out] == list(c.env.eval_difficulties)
  c.eval.split = "val"
  (name, tasks), = X.evaluation_sets(env, c)
  assert name == "val" and [t.task_id for t in tasks] == [
      t.task_id for t in X.train_and_val_tasks(env, c)[1][:5]]
  c.eval.split = "dev"
  with pytest.raises(ValueError, match=r"eval.split='dev'.*'val'"):
    X.evaluation_sets(env, c)
  c.eval.split, c.env.val_tasks = "val", 0
  with pytest.raises(ValueError, match="val_tasks > 0"):
    X.evaluation_sets(env, c)
  c.env.val_tasks = 40
  with pytest.raises(ValueError, match=r"val_tasks=40.*\[0, 39\].*RL needs"):
    X.train_and_val_tasks(env, c)


def test_val_split_of_another_difficulty_keeps_the_whole_train_pool():
  c = _config(val=6)
  c.env.val_difficulty = "hard"
  env = X.make_env(c)
  train, val = X.train_and_val_tasks(env, c)
  assert [t.task_id for t in train] == [
      t.task_id for t in X.task_split(env, "train", c.env.train_difficulty)]
  hard = X.task_split(env, "train", "hard")
  assert [t.task_id for t in val] == [t.task_id for t in hard[-6:]]
  assert {t.difficulty for t in val} == {"hard"}
  c.env.val_tasks = 41
  with pytest.raises(ValueError, match=r"val_tasks=41.*\[0, 40\].*'hard' has 40"):
    X.train_and_val_tasks(env, c)
