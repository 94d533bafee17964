"""The end-of-run plot: readable names, and no curve hidden under an identical one."""
import json

from rao_jax import metrics


def test_identical_curves_are_drawn_once_under_every_name(tmp_path):
  rows = [{"step": s, "train/success": 0.5 * s, "train/success_medium": 0.5 * s,
           "train/reward": 0.1 * s, "train/rl/root_reward_mean": 0.1 * s,
           "train/delegating_share": 1.0, "eval/success_hard": 0.25} for s in range(3)]
  series = dict(metrics.plot_series(rows))
  assert sorted(series) == sorted([
      "success on medium (sampled trees)",
      "root reward (sampled trees)",
      "share of trees delegating (sampled trees)",
      "success on hard (held-out, greedy)"])
  assert not any("/" in label or "_" in label for label in series)
  # Identical curves from one source name it once; from several, each keeps its own.
  same = [{"step": s, "train/success": 0.0, "train/reward": 0.0} for s in range(2)]
  assert [lb for lb, _ in metrics.plot_series(same)] == ["root reward = success (sampled trees)"]
  mixed = [{**r, "eval/success_easy": 0.0} for r in same]
  assert [lb for lb, _ in metrics.plot_series(mixed)] == [
      "success on easy (held-out, greedy) = root reward (sampled trees) = success (sampled trees)"]
  assert series["root reward (sampled trees)"] == [(0, 0.0), (1, 0.1), (2, 0.2)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = metrics.plot_metrics(str(path), str(tmp_path / "plot.png"))
  assert out and (tmp_path / "plot.png").stat().st_size > 1000


def test_labels_of_unknown_keys_are_still_readable():
  assert metrics.metric_label("train/rl/advantage_abs_mean") == \
      "rl advantage abs mean (sampled trees)"
  assert metrics.metric_label("success") == "success"
