r"""The recursion experiment over several RL seeds: one result with intervals across seeds.

Each RL seed is a run of experiments/recursion_evidence.py from the same warm start (its own
--workdir, with --share_stages_from the first run's and --rl_seed), so each seed's workdir
holds `recursive/{eval_before,rl,eval_after}/stage.json` and `single/eval_after/stage.json`,
whose `result` is `{difficulty: {"success", "per_task", "delegating_share", ...}}`. This
module reads them and writes `benchmarks/results/recursion_seeds.json`:

  seeds: [{rl_seed, before, after, paired: {delta, ci95, n}, delegating_share: {before, after},
           vs_single: {delta, ci95}, minutes}]
  across_seeds: {mean_delta, ci95, iqm_delta, improved, worse_significant}
  bar: each item of the bar the seeds are held to, true or false, with its numbers
  complete, seeds_missing: a file written while only some seeds have landed says so

Intervals (rliable's recipe, Agarwal et al. 2021, "Deep RL at the edge of the statistical
precipice"): percentile intervals of a bootstrap. Per seed, the paired per-task differences
(after - before on the same held-out tasks) are resampled over tasks. Across seeds the
bootstrap is stratified: seeds are resampled with replacement and, within each drawn seed,
its tasks with replacement, so both the RL seed and the finite task set count in the interval.
Success rates carry Wilson intervals, which stay inside [0, 1]. The bootstrap generator is
seeded per quantity (and per RL seed), so a rerun writes the same file, and a seed's interval
does not move when another seed lands.

  python -m experiments.recursion_seeds \
      --seed_workdirs=0:runs/recursion,1:runs/recursion_rlseed1,2:runs/recursion_rlseed2
  # a workdir without its seed (`runs/recursion_rlseed3`) reads it from its RL stage's
  # config.json; --out (default benchmarks/results/recursion_seeds.json) gets a plot beside it.
  # From the seeds' committed records (each seed's --carry_out folder, which leaves out the
  # warm start's linked stages), the warm start's read from its own records:
  python -m experiments.recursion_seeds --warm_workdir=benchmarks/results/recursion_runs/warm \
      --seed_workdirs=benchmarks/results/recursion_runs/seed0,benchmarks/results/recursion_runs/seed1
"""
import dataclasses
import json
import os
from typing import Mapping

from absl import app
from absl import flags
import numpy as np

from rao_jax.stats import iqm, percentile_ci95, stratified_bootstrap_means, task_bootstrap_means

# Importing learning_evidence defines --out (and its other flags), which main reads.
from experiments import learning_evidence  # noqa: F401  pylint: disable=unused-import
from experiments.recursion_evidence import wilson95
from experiments.recursion_report import READINGS, rl_minutes

BOOT_SEED = 45        # any fixed value makes the file reproducible
# At 10,000 resamples, over 20 generator seeds: an across-seed interval's ends moved by at most
# 0.006, a seed's own by at most one task (1/64: its paired means live on that grid).
BOOT_REPS = 10_000

_SEED_WORKDIRS = flags.DEFINE_list(
    "seed_workdirs", [], "The seeds' workdirs, each `RL_SEED:PATH` or `PATH` (then the seed "
    "is read from PATH/recursive/rl/config.json).")
_EXPECTED_SEEDS = flags.DEFINE_list(
    "expected_seeds", ["0", "1", "2", "3", "4"],
    "The RL seeds the experiment is to have: those not landed are listed in `seeds_missing`.")
_DIFFICULTY = flags.DEFINE_string("difficulty", "medium", "The held-out evaluations' difficulty.")
_WARM = flags.DEFINE_list(
    "warm_workdir", None, "Where a seed's workdir lacks the warm start's stages (a seed's "
    "committed records under benchmarks/results/recursion_runs/seedK, which leave out what "
    "they linked from the warm start): the warm start's workdir or records to read them from, "
    "e.g. benchmarks/results/recursion_runs/warm. Several (comma-separated; the warm start's "
    "records from CPUs of different kinds, whose weights differ): each seed reads the one whose "
    "weights fingerprint its manifest names.")
_BOOT_REPS = flags.DEFINE_integer("boot_reps", BOOT_REPS, "Bootstrap resamples of each interval.")

# Where a command line does not set --out (learning_evidence's default names its own result).
_DEFAULT_OUT = "benchmarks/results/recursion_seeds.json"

# Generator streams: one per quantity, so adding a quantity never shifts another's draws.
_PAIRED, _VS_SINGLE, _ACROSS = 0, 1, 2
# The bar: at least 4 of 5 seeds improve.
IMPROVED_SHARE_NEEDED = 0.8
# The stages a seed's entry is built from, relative to its workdir.
REQUIRED_STAGES = ("recursive/eval_before", "recursive/rl", "recursive/eval_after",
                   "single/eval_after")
# Of those, the warm start's (shared by every seed, linked into its workdir).
WARM_STAGES = ("recursive/eval_before",)


def _per_task(ev: Mapping, field: str) -> dict:
  per = ev.get("per_task") if isinstance(ev, Mapping) else None
  if not isinstance(per, Mapping) or not per:
    raise ValueError(f"SeedRun.{field}: needs a non-empty `per_task` {{task_id: 0/1}} (an "
                     "evaluation stage's result for one difficulty); got "
                     f"{type(per).__name__ if per is not None else 'none'}.")
  bad = {t: v for t, v in per.items() if not 0.0 <= float(v) <= 1.0}
  if bad:
    raise ValueError(f"SeedRun.{field}.per_task: successes must lie in [0, 1]; got {bad}.")
  return {str(t): float(v) for t, v in per.items()}


@dataclasses.dataclass(frozen=True)
class SeedRun:
  """One RL seed's held-out evaluations, as the stages wrote them (one difficulty).

  Attributes:
    rl_seed: the RL stage's seed (`--rl_seed` of recursion_evidence; 0 is the default run).
    before: the recursive warm start's evaluation: `per_task` {task_id: 0/1} and
      `delegating_share` (share of trees whose root launched a helper).
    after: the recursive policy's evaluation after this seed's RL, on the same tasks.
    single_after: the single agent's evaluation after its RL with this seed, same tasks.
    minutes: what this seed cost beyond the shared warm start (its RL stages and the
      evaluations after them).
  """
  rl_seed: int
  before: Mapping
  after: Mapping
  single_after: Mapping
  minutes: float

  def __post_init__(self):
    if isinstance(self.rl_seed, bool) or not isinstance(self.rl_seed, (int, np.integer)) \
        or self.rl_seed < 0:
      raise ValueError(f"SeedRun.rl_seed: a non-negative int; got {self.rl_seed!r}.")
    tasks = {f: set(_per_task(getattr(self, f), f)) for f in ("before", "after", "single_after")}
    for f in ("after", "single_after"):
      if tasks[f] != tasks["before"]:
        raise ValueError(
            f"SeedRun.{f}: the paired differences need the same held-out tasks as `before`; "
            f"{len(tasks['before'] - tasks[f])} only in before, {len(tasks[f] - tasks['before'])}"
            f" only in {f} (evaluate both with the same --eval_tasks and env seed).")
    for f in ("before", "after"):
      share = getattr(self, f).get("delegating_share")
      if not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise ValueError(f"SeedRun.{f}.delegating_share: a share in [0, 1]; got {share!r} "
                         "(the evaluation's tree statistics write it).")
    if not isinstance(self.minutes, (int, float)) or self.minutes < 0:
      raise ValueError(f"SeedRun.minutes: non-negative minutes; got {self.minutes!r}.")

  def tasks(self) -> list[str]:
    return sorted(_per_task(self.before, "before"))

  def diffs(self, minuend: str, subtrahend: str) -> np.ndarray:
    """Per-task `minuend - subtrahend` over `tasks()` (fields: before, after, single_after)."""
    a, b = _per_task(getattr(self, minuend), minuend), _per_task(getattr(self, subtrahend),
                                                                   subtrahend)
    return np.asarray([a[t] - b[t] for t in self.tasks()], dtype=np.float64)


def _rng(stream: int, rl_seed: int = 0) -> np.random.Generator:
  return np.random.default_rng([BOOT_SEED, stream, int(rl_seed)])


def _success(ev: Mapping, field: str) -> tuple[float, list[float]]:
  per = _per_task(ev, field)
  k = sum(per.values())
  return k / len(per), wilson95(k, len(per))


def seed_entry(run: SeedRun, reps: int = BOOT_REPS) -> dict:
  """One seed's line of `seeds`: success before and after RL (with Wilson intervals), the
  paired effect with its task-bootstrap interval, the delegating shares, the paired
  comparison with the single agent, minutes."""
  d = run.diffs("after", "before")
  vs = run.diffs("after", "single_after")
  before, before_ci = _success(run.before, "before")
  after, after_ci = _success(run.after, "after")
  single, single_ci = _success(run.single_after, "single_after")
  return {
      "rl_seed": int(run.rl_seed),
      "before": before, "before_wilson95": before_ci,
      "after": after, "after_wilson95": after_ci,
      "paired": {"delta": float(d.mean()), "n": len(d),
                 "ci95": percentile_ci95(task_bootstrap_means(d, reps,
                                                              _rng(_PAIRED, run.rl_seed)))},
      "delegating_share": {"before": float(run.before["delegating_share"]),
                           "after": float(run.after["delegating_share"])},
      "vs_single": {"delta": float(vs.mean()), "n": len(vs),
                    "ci95": percentile_ci95(task_bootstrap_means(vs, reps,
                                                                 _rng(_VS_SINGLE, run.rl_seed))),
                    "single_after": single, "single_after_wilson95": single_ci},
      "minutes": float(run.minutes),
  }


def across_seeds(runs: list[SeedRun], entries: list[dict] | None = None,
                 reps: int = BOOT_REPS) -> dict | None:
  """The across-seed effect: mean and IQM of the seeds' paired deltas, each with a stratified
  bootstrap interval over seeds and tasks; the seeds that improved (delta > 0) and those
  significantly worse (paired interval entirely below 0). None without any seed."""
  if not runs:
    return None
  entries = entries or [seed_entry(r, reps) for r in runs]
  deltas = np.asarray([e["paired"]["delta"] for e in entries])
  boot_RxK = stratified_bootstrap_means([r.diffs("after", "before") for r in runs], reps,
                                        _rng(_ACROSS))
  return {
      "n_seeds": len(runs),
      "mean_delta": float(deltas.mean()), "ci95": percentile_ci95(boot_RxK.mean(axis=1)),
      "iqm_delta": float(iqm(deltas)), "iqm_ci95": percentile_ci95(iqm(boot_RxK, axis=1)),
      "improved": [e["rl_seed"] for e in entries if e["paired"]["delta"] > 0],
      "worse_significant": [e["rl_seed"] for e in entries if e["paired"]["ci95"][1] < 0],
  }


def bar(entries: list[dict], across: dict | None, expected: list[int]) -> dict:
  """The bar the seeds are held to, item by item, judged on the seeds landed (`seeds_judged`); `met` only
  when every expected seed has landed and every item holds.

  The delegating share is kept when it moved by at most one tree of the held-out set either
  way: drift toward more delegation (what a baseline above 1 rewarded) fails it as a drop does."""
  needed = int(np.ceil(IMPROVED_SHARE_NEEDED * len(expected)))
  improved = (across or {}).get("improved", [])
  worse = (across or {}).get("worse_significant", [])
  shares = []
  for e in entries:
    s, n = e["delegating_share"], e["paired"]["n"]
    moved = (s["after"] - s["before"]) * n
    # Shares are counts over n trees: a rounding margin keeps exactly one tree inside.
    shares.append({"rl_seed": e["rl_seed"], **s, "trees_moved": round(moved, 6),
                   "within_one_tree": bool(abs(moved) <= 1 + 1e-6)})
  single = [{"rl_seed": e["rl_seed"], "delta": e["vs_single"]["delta"],
             "ci95": e["vs_single"]["ci95"], "beats": bool(e["vs_single"]["ci95"][0] > 0)}
            for e in entries]
  items = {
      "mean_effect_above_0": {
          "pass": bool(across is not None and across["ci95"][0] > 0),
          "mean_delta": across and across["mean_delta"], "ci95": across and across["ci95"]},
      "seeds_improve_none_worse": {
          "pass": bool(len(improved) >= needed and not worse), "improved": improved,
          "needed": needed, "of": len(expected), "worse_significant": worse},
      "delegating_share_within_one_tree": {
          "pass": bool(entries) and all(s["within_one_tree"] for s in shares),
          "seeds": shares},
      "every_seed_beats_single": {
          "pass": bool(entries) and all(s["beats"] for s in single), "seeds": single},
  }
  landed = {e["rl_seed"] for e in entries}
  return {"met": bool(set(expected) <= landed and all(i["pass"] for i in items.values())),
          "seeds_judged": sorted(landed), **items}


def seeds_result(runs: list[SeedRun], expected: list[int], reps: int = BOOT_REPS,
                 pending: list[dict] = ()) -> dict:
  """The whole result of `runs` (any subset of the `expected` seeds): seeds, across_seeds,
  bar, and what is still missing."""
  seen = [r.rl_seed for r in runs]
  if len(set(seen)) != len(seen):
    raise ValueError(f"RL seeds {sorted(seen)}: each seed once (two workdirs name one seed).")
  runs = sorted(runs, key=lambda r: r.rl_seed)
  entries = [seed_entry(r, reps) for r in runs]
  across = across_seeds(runs, entries, reps)
  missing = sorted(set(expected) - set(seen))
  return {
      "expected_seeds": sorted(expected), "complete": not missing, "seeds_missing": missing,
      "seeds_pending": list(pending),
      "seeds": entries, "across_seeds": across, "bar": bar(entries, across, expected),
      "minutes": float(sum(e["minutes"] for e in entries)),
      "bootstrap": {"reps": reps, "generator_seed": BOOT_SEED, "interval": "percentile 95%",
                    "per_seed": "tasks resampled with replacement",
                    "across_seeds": "seeds resampled with replacement, then each drawn "
                                    "seed's tasks with replacement (stratified)"},
  }


def write_seeds(runs: list[SeedRun], out: str, expected: list[int], reps: int = BOOT_REPS,
                pending: list[dict] = (), extra: Mapping | None = None,
                plot: bool = True) -> dict:
  """Writes `seeds_result(...)` (with `extra` keys) as JSON at `out`, a plot beside it."""
  result = {**(extra or {}), **seeds_result(runs, expected, reps, pending)}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
    f.write("\n")
  os.replace(out + ".tmp", out)
  if plot and result["seeds"]:
    plot_seeds(result, os.path.splitext(out)[0] + ".png")
  return result


# -- reading the seeds' workdirs ---------------------------------------------------------------


def _marker(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def workdir_seed(workdir: str) -> int:
  """The RL seed a workdir's RL stage ran with (its config.json's `seed`)."""
  path = os.path.join(workdir, "recursive", "rl", "config.json")
  cfg = _marker(path)
  if cfg is None or "seed" not in cfg:
    raise ValueError(f"{workdir}: no RL seed in {path}; name it: "
                     f"--seed_workdirs=RL_SEED:{workdir}")
  return int(cfg["seed"])


def seed_minutes(workdir: str) -> float:
  """Minutes of a seed's own stages: each mode's RL (its steps' recorded times where a stopped
  and resumed stage's marker counts only the last part) and the evaluations after it. The
  warm start's stages are shared by the seeds and not counted."""
  total = 0.0
  for mode in ("recursive", "single"):
    for stage in ["rl", "eval_after"] + (
        [f"reading_{n}_after" for n in READINGS] if mode == "recursive" else []):
      m = _marker(os.path.join(workdir, mode, stage, "stage.json"))
      if m is None:
        continue
      spent = m.get("minutes", 0.0)
      if stage == "rl":
        spent = max(spent, rl_minutes(os.path.join(workdir, mode, "rl")))
      total += spent
  return total


def load_seed(workdir: str, rl_seed: int | None = None, difficulty: str = "medium",
              warm: str | None = None) -> tuple[SeedRun | None, list[str]]:
  """A seed's SeedRun from its workdir, or (None, the REQUIRED_STAGES not yet complete); a
  warm-start stage (WARM_STAGES) the workdir lacks is read from `warm` when given."""
  got = {s: _marker(os.path.join(workdir, s, "stage.json")) for s in REQUIRED_STAGES}
  for s in WARM_STAGES:
    if got[s] is None and warm:
      got[s] = _marker(os.path.join(warm, s, "stage.json"))
  missing = [s for s, m in got.items() if m is None]
  if missing:
    return None, missing
  evals = {}
  for s in ("recursive/eval_before", "recursive/eval_after", "single/eval_after"):
    res = got[s]["result"]
    if difficulty not in res:
      raise ValueError(f"{os.path.join(workdir, s, 'stage.json')}: no {difficulty!r} "
                       f"evaluation (it has {sorted(res)}); set --difficulty.")
    evals[s] = res[difficulty]
  return SeedRun(rl_seed=workdir_seed(workdir) if rl_seed is None else int(rl_seed),
                 before=evals["recursive/eval_before"], after=evals["recursive/eval_after"],
                 single_after=evals["single/eval_after"],
                 minutes=seed_minutes(workdir)), []


def parse_seed_workdirs(specs) -> list[tuple[int | None, str]]:
  """`RL_SEED:PATH` or `PATH` items as (seed or None, path)."""
  out = []
  for spec in specs:
    head, sep, tail = spec.partition(":")
    if sep and head.strip().isdigit():
      out.append((int(head), tail))
    elif sep and not os.path.exists(spec):
      raise ValueError(f"--seed_workdirs item {spec!r}: use RL_SEED:PATH with a non-negative "
                       "integer seed, or PATH.")
    else:
      out.append((None, spec))
  return out


def _warm_sha256(path: str) -> str | None:
  """The recursive warm start's weights fingerprint a carried folder's manifest names."""
  m = _marker(os.path.join(path, "manifest.json")) or {}
  want = m.get("warm_sha256")
  return want.get("recursive") if isinstance(want, dict) else want


def warm_for(seed_path: str, warms: list[str]) -> str | None:
  """The warm start `seed_path` was trained from, of `warms`: the only one, or the one whose
  manifest names the weights fingerprint the seed's manifest names."""
  if len(warms) <= 1:
    return warms[0] if warms else None
  want = _warm_sha256(seed_path)
  have = {w: _warm_sha256(w) for w in warms}
  match = [w for w, fp in have.items() if want and fp == want]
  if not match:
    raise ValueError(
        f"{seed_path}: its manifest names the warm start {str(want)[:8]}, and none of "
        f"--warm_workdir has it ({', '.join(f'{w}: {str(fp)[:8]}' for w, fp in have.items())}); "
        "add the records of the warm start it ran from.")
  return match[0]


def write_from_workdirs(specs: list[tuple[int | None, str]], out: str, expected: list[int],
                        difficulty: str = "medium", reps: int = BOOT_REPS,
                        plot: bool = True, warm: str | list[str] | None = None) -> dict:
  """The result file from the seeds' workdirs: landed seeds in `seeds`, a workdir whose stages
  are not all complete in `seeds_pending` (with what it lacks), absent seeds in
  `seeds_missing`. `warm`: the warm start's records (several: one per CPU kind, matched to each
  seed by weights fingerprint)."""
  warms = [warm] if isinstance(warm, str) else list(warm or [])
  runs, pending, sources = [], [], []
  for seed, path in specs:
    seed_warm = warm_for(path, warms)
    run, missing = load_seed(path, seed, difficulty, seed_warm)
    if run is None:
      if seed is None:
        cfg = _marker(os.path.join(path, "recursive", "rl", "config.json")) or {}
        seed = cfg.get("seed")
      pending.append({"rl_seed": seed, "workdir": path, "stages_missing": missing})
      continue
    runs.append(run)
    sources.append({"rl_seed": run.rl_seed, "workdir": path, "warm_workdir": seed_warm,
                    "warm_sha256": _warm_sha256(path)})
  extra = {"difficulty": difficulty, "sources": sorted(sources, key=lambda s: s["rl_seed"])}
  return write_seeds(runs, out, expected, reps, pending, extra, plot)


# -- the plot ----------------------------------------------------------------------------------


def plot_seeds(result: dict, path: str) -> None:
  """Left: each seed's held-out success before and after RL and the single agent's, with Wilson
  intervals. Right: each seed's paired effect with its task-bootstrap interval, then the
  across-seed mean and IQM with their stratified intervals."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  seeds = result["seeds"]
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.8))
  xs = np.arange(len(seeds))

  def bars(ax, x, ys, cis, **kw):
    err = np.asarray([[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]])
    ax.errorbar(x, ys, yerr=np.clip(err, 0, None), fmt="o", capsize=4, **kw)

  bars(ax0, xs - 0.2, [e["before"] for e in seeds], [e["before_wilson95"] for e in seeds],
       color="0.5", label="warm start")
  bars(ax0, xs, [e["after"] for e in seeds], [e["after_wilson95"] for e in seeds],
       color="C0", label="after RL")
  bars(ax0, xs + 0.2, [e["vs_single"]["single_after"] for e in seeds],
       [e["vs_single"]["single_after_wilson95"] for e in seeds], color="C3",
       label="single agent after RL")
  for x, e in zip(xs, seeds):
    ax0.plot([x - 0.2, x], [e["before"], e["after"]], color="C0", lw=0.8)
  ax0.set_xticks(xs, [f"seed {e['rl_seed']}" for e in seeds])
  ax0.set_ylim(-0.02, 1.02)
  ax0.set_ylabel(f"held-out greedy success ({seeds[0]['paired']['n']} tasks), Wilson 95%")
  # Below the panels: success spans the whole axis, so no corner of it is free.
  fig.legend(*ax0.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=3)
  labels = [f"seed {e['rl_seed']}" for e in seeds]
  ys, cis = [e["paired"]["delta"] for e in seeds], [e["paired"]["ci95"] for e in seeds]
  bars(ax1, xs, ys, cis, color="C0")
  across = result["across_seeds"]
  bars(ax1, [len(seeds), len(seeds) + 1], [across["mean_delta"], across["iqm_delta"]],
       [across["ci95"], across["iqm_ci95"]], color="k")
  ax1.axhline(0, color="0.6", lw=0.8)
  ax1.set_xticks(range(len(seeds) + 2), labels + ["mean\n(stratified)", "IQM\n(stratified)"])
  ax1.set_ylabel("paired effect after - before RL, bootstrap 95%")
  done = "" if result["complete"] else (
      f" ({len(seeds)} of {len(result['expected_seeds'])} seeds landed)")
  fig.suptitle(f"Recursive agent after RL, per RL seed{done}: bar "
               f"{'met' if result['bar']['met'] else 'not met'}")
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  out_flag = flags.FLAGS["out"]
  out = out_flag.value if out_flag.present else _DEFAULT_OUT
  if not _SEED_WORKDIRS.value:
    raise app.UsageError("--seed_workdirs: name at least one seed's workdir.")
  try:
    expected = [int(s) for s in _EXPECTED_SEEDS.value]
    specs = parse_seed_workdirs(_SEED_WORKDIRS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  result = write_from_workdirs(specs, out, expected, _DIFFICULTY.value, _BOOT_REPS.value,
                               warm=_WARM.value)
  print(json.dumps({k: result[k] for k in ("complete", "seeds_missing", "across_seeds")}
                   | {"bar_met": result["bar"]["met"]}))


if __name__ == "__main__":
  app.run(main)
