"""Evaluation inputs and statistics: the held-out split, task files per split, pass@k, and a
gold replay that does not starve later steps."""
import json
import math
import random

import pytest

from rao_jax import evaluation
from rao_jax.envs import base
from rao_jax.envs import registry
from rao_jax.envs import textcraft as tc


@pytest.fixture(scope="module")
def env():
  return tc.TextCraftEnv()


def test_textcraft_held_out_split_is_disjoint_from_train(env):
  train, test, every = env.tasks("train"), env.tasks("test"), env.tasks("all")
  assert (len(train), len(test), len(every)) == (900, 100, 1000)
  assert not {t.task_id for t in train} & {t.task_id for t in test}
  assert test[0].task_id == "textcraft.train.9" and test[1].task_id == "textcraft.train.19"
  assert registry.HELD_OUT_SPLIT == "test"
  with pytest.raises(ValueError, match="known splits"):
    env.tasks("val")


def test_task_files_per_split(tmp_path, env):
  picked = [env.tasks("train")[i] for i in (0, 1, 2)]
  tagged = [base.Task(t.task_id + ".x", t.env, t.goal, dict(t.fields), d, t.max_steps)
            for t, d in zip(picked, ("easy", "hard", "hard"))]
  path = tmp_path / "test.jsonl"
  tc.save_textcraft_jsonl(str(path), tagged)
  e = registry.make_env("textcraft", {}, task_files={"test": str(path)})
  assert [t.task_id for t in e.tasks("test")] == [t.task_id for t in tagged]
  assert [t.task_id for t in e.tasks("test/hard")] == [t.task_id for t in tagged[1:]]
  assert len(e.tasks("train")) == 900          # splits without a file: the environment's
  # The RAO authors' lines load unchanged (misc.target_items etc.).
  line = json.loads(path.read_text().splitlines()[0])
  assert set(line) == {"goal", "id", "max_steps", "misc"}
  assert e.tasks("test")[0].fields["target_items"] == picked[0].fields["target_items"]
  with pytest.raises(FileNotFoundError, match="config.env.task_files.test"):
    registry.make_env("textcraft", {}, task_files={"test": str(tmp_path / "missing.jsonl")})
  # Other environments read Task.to_dict() lines.
  g = tmp_path / "lc.jsonl"
  g.write_text(json.dumps({"task_id": "q1", "goal": "count the cats", "fields": {"gold": 3},
                           "difficulty": "easy", "max_steps": 7}) + "\n")
  lc = registry.make_env("longcontext", {}, task_files={"test": str(g)})
  (t,) = lc.tasks("test")
  assert (t.task_id, t.env, t.fields, t.max_steps) == ("q1", "longcontext", {"gold": 3}, 7)
  # evaluation.make_env merges config.env.task_files with explicit ones.
  import ml_collections
  cfg = ml_collections.ConfigDict({"env": {"name": "textcraft", "kwargs": {},
                                           "task_files": {"train": ""}}})
  e2 = evaluation.make_env(cfg, {"test": str(path)})
  assert len(e2.tasks("test")) == 3 and len(e2.tasks("train")) == 900


def test_pass_at_k_is_the_unbiased_estimator():
  assert evaluation.pass_at_k(5, 0, 3) == 0.0
  assert evaluation.pass_at_k(5, 3, 3) == 1.0          # fewer than k failures
  assert evaluation.pass_at_k(4, 1, 1) == pytest.approx(0.25)
  assert evaluation.pass_at_k(10, 2, 3) == pytest.approx(1 - math.comb(8, 3) / math.comb(10, 3))
  # It is the probability that k draws without replacement hit a pass: check by simulation.
  rng = random.Random(0)
  pool = [1] * 3 + [0] * 5
  sim = sum(any(rng.sample(pool, 4)) for _ in range(20000)) / 20000
  assert sim == pytest.approx(evaluation.pass_at_k(8, 3, 4), abs=0.01)
  with pytest.raises(ValueError):
    evaluation.pass_at_k(3, 1, 4)

  class Tree:
    def __init__(self, tid, s):
      self.task_id = tid
      self.root = type("Root", (), {"success": s})()
  trees = [Tree("a", 1.0), Tree("a", 0.0), Tree("b", 0.0), Tree("b", 0.5)]
  st = evaluation.sampled_stats(trees, 2)
  assert st["pass_at_k"] == {"1": pytest.approx(0.25), "2": pytest.approx(0.5)}
  assert st["sampled_success"] == pytest.approx(0.375)
  assert st["per_task_passes"] == {"a": 1, "b": 0}
  with pytest.raises(ValueError, match="expected 3"):
    evaluation.sampled_stats(trees, 3)


def test_replay_gold_fill_keeps_what_later_steps_need(env):
  # Sticks take any planks; the acacia fence gate then needs acacia planks by name. Filling
  # the sticks' planks alphabetically (acacia first) starved the gate.
  task = base.Task("gate", "textcraft", "Craft 1x acacia_fence_gate", fields={
      "target_items": {"acacia_fence_gate": 1},
      "initial_inventory": {"acacia_planks": 4, "spruce_planks": 2},
      "gold_trajectory": [
          {"action": "craft", "target": ["stick", 2], "ingredients": {"tag:planks": 4},
           "result_count": 8},
          {"action": "craft", "target": ["acacia_fence_gate", 1],
           "ingredients": {"stick": 4, "acacia_planks": 2}, "result_count": 1}]})
  ep, msgs = tc.replay_gold(env, task)
  assert not [m for m in msgs if m.startswith("Error")], msgs
  assert ep.view_inventory().get("acacia_fence_gate") == 1
  assert ep.view_inventory().get("stick") == 4
