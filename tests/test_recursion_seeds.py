"""The recursion experiment's across-seed result: per-seed and stratified bootstrap intervals,
the IQM, the bar item by item, partial runs, and the seeds' workdirs read as the stages lay
them out (synthetic per-task outcomes; no model runs here)."""
import json
import os

import numpy as np
import pytest

from experiments import recursion_seeds as rs

N = 64  # held-out medium tasks, as in the experiment
EXPECTED = [0, 1, 2, 3, 4]
# Fewer resamples than the file's 10,000 keep each test well under a second; the intervals
# asserted below are far from their thresholds at either count.
REPS = 2000


def _eval(successes: list[float], share: float) -> dict:
  return {"success": float(np.mean(successes)), "delegating_share": share,
          "per_task": {f"test-{i:03d}": float(s) for i, s in enumerate(successes)}}


def _bits(k: int, n: int = N, offset: int = 0) -> list[float]:
  """k successes among n tasks, starting at task `offset` (wrapping)."""
  out = [0.0] * n
  for i in range(k):
    out[(offset + i) % n] = 1.0
  return out


def _run(seed: int, before: int = 40, gained: int = 14, lost: int = 2, single: int = 5,
         share_before: float = 0.9375, share_after: float = 0.9375, minutes=100.0):
  """A seed whose policy after RL solves the warm start's `before` tasks less `lost` of them,
  plus `gained` tasks the warm start failed (paired delta (gained - lost) / N)."""
  b = _bits(before)
  a = list(b)
  for i in range(lost):
    a[i] = 0.0
  for i in range(gained):
    a[before + i] = 1.0
  return rs.SeedRun(rl_seed=seed, before=_eval(b, share_before), after=_eval(a, share_after),
                    single_after=_eval(_bits(single, offset=seed), 0.0), minutes=minutes)


def _good_five():
  return [_run(s, gained=10 + 2 * s, lost=s % 2) for s in EXPECTED]


def test_across_seeds_iqm_is_robust_to_one_outlying_seed():
  # The IQM of the per-seed paired deltas (rao_jax.stats.iqm), with its interval.
  runs = [_run(s, gained=g) for s, g in zip(EXPECTED, (2, 6, 10, 14, 24))]
  across = rs.across_seeds(runs, reps=REPS)
  assert across["iqm_delta"] == pytest.approx((4 + 8 + 12) / 3 / N)
  assert across["mean_delta"] == pytest.approx((0 + 4 + 8 + 12 + 22) / 5 / N)
  lo, hi = across["iqm_ci95"]
  assert lo <= across["iqm_delta"] <= hi


def test_intervals_stay_inside_their_bounds_and_hold_their_estimates():
  # Extremes: a warm start that fails every task and a policy that solves every one.
  extreme = rs.SeedRun(0, _eval(_bits(0), 0.0), _eval(_bits(N), 1.0), _eval(_bits(N), 0.0),
                       10.0)
  # Four tasks, where a normal interval of 1/4 would reach below 0.
  small = rs.SeedRun(3, _eval([1, 0, 0, 0], 0.5), _eval([1, 1, 1, 0], 0.5),
                     _eval([0, 0, 0, 1], 0.0), 10.0)
  runs = [extreme] + [_run(s) for s in (1, 2)] + [small]
  result = rs.seeds_result(runs, EXPECTED, reps=REPS)
  for e in result["seeds"]:
    for key in ("before", "after"):
      lo, hi = e[f"{key}_wilson95"]
      assert 0.0 <= lo <= e[key] <= hi <= 1.0
    lo, hi = e["vs_single"]["single_after_wilson95"]
    assert 0.0 <= lo <= e["vs_single"]["single_after"] <= hi <= 1.0
    for part in ("paired", "vs_single"):
      lo, hi = e[part]["ci95"]
      assert -1.0 <= lo <= e[part]["delta"] <= hi <= 1.0
  e0 = result["seeds"][0]
  assert e0["before"] == 0.0 and e0["after"] == 1.0 and e0["before_wilson95"][0] == 0.0
  assert e0["after_wilson95"][1] == 1.0 and e0["paired"]["ci95"] == [1.0, 1.0]
  # Wilson's interval keeps a width at 0 and 1 (0 of 64: up to 0.057), where the normal one
  # collapses to a point.
  assert e0["before_wilson95"] == pytest.approx([0.0, 0.0566], abs=1e-4)
  assert e0["after_wilson95"] == pytest.approx([0.9434, 1.0], abs=1e-4)
  assert result["seeds"][3]["before_wilson95"] == pytest.approx([0.0456, 0.6994], abs=1e-4)
  assert e0["paired"]["n"] == N and e0["vs_single"]["delta"] == 0.0
  across = result["across_seeds"]
  assert across["ci95"][0] <= across["mean_delta"] <= across["ci95"][1]
  # The stratified interval counts the seeds' spread: over seeds of 64 tasks each, wider than
  # any one seed's own (resampling tasks alone would make it narrower).
  wide = rs.across_seeds(runs[:3], reps=REPS)["ci95"]
  assert wide[1] - wide[0] > max(
      e["paired"]["ci95"][1] - e["paired"]["ci95"][0] for e in result["seeds"][:3])


def test_a_clearly_worse_seed_is_flagged_and_fails_the_bar():
  runs = _good_five()[:4] + [_run(4, gained=0, lost=20)]
  result = rs.seeds_result(runs, EXPECTED, reps=REPS)
  worse = result["seeds"][4]
  assert worse["paired"]["delta"] == pytest.approx(-20 / N) and worse["paired"]["ci95"][1] < 0
  assert result["across_seeds"]["worse_significant"] == [4]
  assert result["across_seeds"]["improved"] == [0, 1, 2, 3]
  item = result["bar"]["seeds_improve_none_worse"]
  assert item["improved"] == [0, 1, 2, 3] and item["needed"] == 4 and not item["pass"]
  assert not result["bar"]["met"]
  # A seed slightly worse by chance is not significantly worse.
  runs[4] = _run(4, gained=1, lost=2)
  result = rs.seeds_result(runs, EXPECTED, reps=REPS)
  assert result["seeds"][4]["paired"]["ci95"][1] > 0
  assert result["across_seeds"]["worse_significant"] == []
  assert result["bar"]["seeds_improve_none_worse"]["pass"]


def test_bar_met_by_five_good_seeds_and_not_when_two_fail():
  result = rs.seeds_result(_good_five(), EXPECTED, reps=REPS)
  bar = result["bar"]
  assert bar["met"] and bar["seeds_judged"] == EXPECTED
  assert all(bar[k]["pass"] for k in ("mean_effect_above_0", "seeds_improve_none_worse",
                                      "delegating_share_within_one_tree",
                                      "every_seed_beats_single"))
  assert bar["mean_effect_above_0"]["ci95"][0] > 0
  # Two seeds with no effect: 3 of 5 improve. The mean interval may still clear 0; the bar
  # does not.
  runs = _good_five()[:3] + [_run(3, gained=0, lost=0), _run(4, gained=1, lost=1)]
  bar = rs.seeds_result(runs, EXPECTED, reps=REPS)["bar"]
  assert bar["seeds_improve_none_worse"]["improved"] == [0, 1, 2]
  assert not bar["seeds_improve_none_worse"]["pass"] and not bar["met"]
  assert bar["mean_effect_above_0"]["pass"]


def test_delegating_share_within_one_tree_and_beating_the_single_agent():
  # One tree either way is kept; two trees more delegation (drift) fails as a drop does.
  runs = _good_five()
  runs[1] = _run(1, gained=12, share_after=0.9375 - 1 / N)
  runs[2] = _run(2, gained=14, share_after=0.9375 + 1 / N)
  bar = rs.seeds_result(runs, EXPECTED, reps=REPS)["bar"]
  assert bar["delegating_share_within_one_tree"]["pass"] and bar["met"]
  runs[3] = _run(3, gained=16, share_before=0.875, share_after=0.875 + 2 / N)
  bar = rs.seeds_result(runs, EXPECTED, reps=REPS)["bar"]
  item = bar["delegating_share_within_one_tree"]
  assert not item["pass"] and not bar["met"]
  assert [s["trees_moved"] for s in item["seeds"]] == pytest.approx([0, -1, 1, 2, 0])
  # A seed that ties the single agent (as many tasks, paired interval across 0).
  runs = _good_five()
  runs[0] = _run(0, before=40, gained=0, lost=0, single=40)
  bar = rs.seeds_result(runs, EXPECTED, reps=REPS)["bar"]
  assert [s["beats"] for s in bar["every_seed_beats_single"]["seeds"]] == [
      False, True, True, True, True]
  assert not bar["every_seed_beats_single"]["pass"] and not bar["met"]


def test_the_file_is_reproducible(tmp_path):
  runs = _good_five()
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  rs.write_seeds(runs, str(a), EXPECTED, reps=REPS, plot=False)
  rs.write_seeds(list(reversed(runs)), str(b), EXPECTED, reps=REPS, plot=False)
  assert a.read_bytes() == b.read_bytes()
  # A seed's own intervals do not move when other seeds land.
  part = rs.seeds_result(runs[:2], EXPECTED, reps=REPS)
  full = json.loads(a.read_text())
  assert part["seeds"] == full["seeds"][:2]


def test_a_partial_run_says_which_seeds_are_missing(tmp_path):
  out = tmp_path / "seeds.json"
  result = rs.write_seeds(_good_five()[:2], str(out), EXPECTED, reps=REPS, plot=False)
  assert json.loads(out.read_text()) == result
  assert not result["complete"] and result["seeds_missing"] == [2, 3, 4]
  assert [e["rl_seed"] for e in result["seeds"]] == [0, 1]
  assert result["across_seeds"]["n_seeds"] == 2
  bar = result["bar"]
  # Judged on the two landed seeds, and not met: 2 improved seeds are fewer than 4.
  assert bar["seeds_judged"] == [0, 1] and not bar["met"]
  assert not bar["seeds_improve_none_worse"]["pass"]
  assert bar["delegating_share_within_one_tree"]["pass"]
  # Nothing landed yet: an honest empty file.
  empty = rs.seeds_result([], EXPECTED, reps=REPS)
  assert empty["across_seeds"] is None and empty["seeds_missing"] == EXPECTED
  assert not any(v["pass"] for k, v in empty["bar"].items() if isinstance(v, dict))


def test_bad_input_is_named():
  good = _run(0)
  with pytest.raises(ValueError, match="SeedRun.after: the paired differences"):
    rs.SeedRun(0, good.before, _eval(_bits(10, n=N - 1), 0.5), good.single_after, 1.0)
  with pytest.raises(ValueError, match=r"SeedRun.before.delegating_share"):
    rs.SeedRun(0, {"per_task": good.before["per_task"]}, good.after, good.single_after, 1.0)
  with pytest.raises(ValueError, match=r"SeedRun.single_after.per_task: .*\[0, 1\]"):
    rs.SeedRun(0, good.before, good.after, _eval([2.0] * N, 0.0), 1.0)
  with pytest.raises(ValueError, match="SeedRun.rl_seed"):
    rs.SeedRun(-1, good.before, good.after, good.single_after, 1.0)
  with pytest.raises(ValueError, match="each seed once"):
    rs.seeds_result([good, _run(0)], EXPECTED, reps=REPS)
  with pytest.raises(ValueError, match="RL_SEED:PATH"):
    rs.parse_seed_workdirs(["x1:/nonexistent/seed"])
  assert rs.parse_seed_workdirs(["3:runs/a", "runs/b"]) == [(3, "runs/a"), (None, "runs/b")]


def _stage(path, result, minutes):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "stage.json"), "w") as f:
    json.dump({"minutes": minutes, "result": result}, f)


def _workdir(root, run: rs.SeedRun, warm: str | None, last: bool = True):
  """A seed's workdir as recursion_evidence lays it out; the warm start's stages linked from
  `warm` as --share_stages_from links them (or written here when `warm` is None)."""
  rec = os.path.join(root, "recursive")
  if warm is None:
    _stage(os.path.join(rec, "eval_before"), {"medium": run.before}, 15.0)
  else:
    os.makedirs(rec, exist_ok=True)
    os.symlink(os.path.join(warm, "recursive", "eval_before"), os.path.join(rec, "eval_before"))
  _stage(os.path.join(rec, "rl"), {"step": 4}, 50.0)
  with open(os.path.join(rec, "rl", "config.json"), "w") as f:
    json.dump({"seed": run.rl_seed}, f)
  _stage(os.path.join(rec, "reading_hard_after"), {}, 20.0)
  _stage(os.path.join(root, "single", "rl"), {"step": 4}, 3.0)
  _stage(os.path.join(root, "single", "eval_after"), {"medium": run.single_after}, 2.0)
  if last:
    _stage(os.path.join(rec, "eval_after"), {"medium": run.after}, 18.0)


def test_seeds_read_from_their_workdirs(tmp_path):
  runs = _good_five()
  w0 = str(tmp_path / "seed0")
  _workdir(w0, runs[0], None)
  _workdir(str(tmp_path / "seed1"), runs[1], w0)
  _workdir(str(tmp_path / "seed2"), runs[2], w0, last=False)   # its evaluation still running
  specs = rs.parse_seed_workdirs([w0, f"1:{tmp_path / 'seed1'}", str(tmp_path / "seed2")])
  out = str(tmp_path / "results" / "recursion_seeds.json")
  result = rs.write_from_workdirs(specs, out, EXPECTED, reps=REPS)
  assert os.path.exists(out) and os.path.getsize(out[:-len(".json")] + ".png") > 0
  assert [e["rl_seed"] for e in result["seeds"]] == [0, 1]
  # The seed's own stages only (RL, evaluations after it); the shared warm start is not.
  assert [e["minutes"] for e in result["seeds"]] == [50 + 20 + 3 + 2 + 18] * 2
  assert result["seeds_pending"] == [{"rl_seed": 2, "workdir": str(tmp_path / "seed2"),
                                      "stages_missing": ["recursive/eval_after"]}]
  assert result["seeds_missing"] == [2, 3, 4] and not result["complete"]
  # The same numbers as the runs given directly.
  direct = rs.seeds_result(runs[:2], EXPECTED, reps=REPS)
  for got, want in zip(result["seeds"], direct["seeds"]):
    assert {**got, "minutes": 0} == {**want, "minutes": 0}
  assert result["across_seeds"] == direct["across_seeds"]
  with pytest.raises(ValueError, match="no 'hard' evaluation"):
    rs.write_from_workdirs(specs[:1], out, EXPECTED, difficulty="hard", reps=REPS)


def test_a_seeds_committed_records_read_the_warm_start_from_its_own(tmp_path):
  """A seed's records leave out the warm start's linked stages; --warm_workdir supplies them."""
  runs = _good_five()
  warm, seed = str(tmp_path / "warm"), str(tmp_path / "seed1")
  _stage(os.path.join(warm, "recursive", "eval_before"), {"medium": runs[1].before}, 15.0)
  _workdir(seed, runs[1], warm)
  os.unlink(os.path.join(seed, "recursive", "eval_before"))     # as carried: not there
  assert rs.load_seed(seed)[1] == ["recursive/eval_before"]
  got, missing = rs.load_seed(seed, warm=warm)
  assert not missing and got.before == runs[1].before and got.rl_seed == 1
  # Only the warm start's stages come from there: the seed's own must be its own.
  _stage(os.path.join(warm, "single", "eval_after"), {"medium": runs[1].single_after}, 2.0)
  os.remove(os.path.join(seed, "single", "eval_after", "stage.json"))
  assert rs.load_seed(seed, warm=warm)[1] == ["single/eval_after"]


def test_seeds_from_warm_starts_of_two_cpu_kinds_each_read_their_own(tmp_path):
  """The warm start's records from two CPU kinds (other weights, other evaluations): each
  seed's records name the fingerprint they ran from, and read that warm start's stages."""
  runs = _good_five()
  warms, specs = [], []
  for i, fp in ((0, "aaaa"), (1, "bbbb")):
    warm, seed = str(tmp_path / f"warm_{fp}"), str(tmp_path / f"seed{i}")
    _stage(os.path.join(warm, "recursive", "eval_before"), {"medium": runs[i].before}, 15.0)
    _workdir(seed, runs[i], warm)
    os.unlink(os.path.join(seed, "recursive", "eval_before"))    # as carried: not there
    for d in (warm, seed):
      with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"warm_sha256": {"recursive": fp, "single": "s"}, "files": []}, f)
    warms.append(warm)
    specs.append((None, seed))
  out = str(tmp_path / "seeds.json")
  result = rs.write_from_workdirs(specs, out, EXPECTED, reps=REPS, plot=False,
                                  warm=warms[::-1])
  direct = rs.seeds_result(runs[:2], EXPECTED, reps=REPS)
  for got, want in zip(result["seeds"], direct["seeds"]):
    assert {**got, "minutes": 0} == {**want, "minutes": 0}
  assert [(s["warm_workdir"], s["warm_sha256"]) for s in result["sources"]] == [
      (warms[0], "aaaa"), (warms[1], "bbbb")]
  with pytest.raises(ValueError, match=r"seed1: its manifest names the warm start bbbb, and "
                     r"none of --warm_workdir has it .*warm_aaaa: aaaa"):
    rs.write_from_workdirs(specs, out, EXPECTED, reps=REPS, plot=False,
                           warm=[warms[0], str(tmp_path / "seed0")])
