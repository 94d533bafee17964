r"""The RL recipe of the recursion experiment, chosen on train tasks only, then frozen.

The warm start (experiments/recursion_evidence.py, scale `cpu_rao`) holds out a validation
split of train tasks (`env.val_tasks`, never a demonstration nor an RL task). Each candidate
recipe trains from that warm start and is checked greedily on the validation split after every
step; its drift metrics (`rao_jax.metrics.drift_stats`) are logged per step. The held-out test
tasks are never read here. Stages under --workdir, each resumable (a complete stage is kept):

  val_before     the warm start's greedy success on the validation split (step 0 of each curve);
  <name>/rl      RL from the warm start with the candidate's recipe (--candidates NAME:RECIPE,
                 RECIPE as recursion_evidence.parse_recipe reads it).

Then --out (benchmarks/results/recursion_recipe.json): each candidate's recipe, its validation
curve, sampled success and drift per step, its best step, and the choice under the rule in
`RULE` (fixed before any candidate ran).

  python -m experiments.recursion_recipe --warm=runs/rao/warm --workdir=runs/rao/recipe \
      --candidates=lam0_lr1e-4:lr=1e-4,lam=0 --candidates=lam05_lr1e-4:lr=1e-4,lam=0.5
  python -m experiments.recursion_recipe --warm=runs/rao/warm --workdir=runs/rao/recipe \
      --candidates=... --report_only     # the JSON from the stages on disk
"""
import json
import os

from absl import app
from absl import flags

from experiments import carry
from experiments import learning_evidence as le
from experiments import recursion_evidence as rec

_WARM = flags.DEFINE_string("warm", "runs/rao/warm", "A recursion_evidence workdir whose "
                            "recursive/sft stage is complete (the warm start).")
_CANDIDATES = flags.DEFINE_multi_string(
    "candidates", [], "NAME:RECIPE, e.g. lam0_lr1e-4:lr=1e-4,lam=0 (keys: "
    f"{', '.join(sorted(rec.RECIPE_FIELDS))}).")
_NOTES = flags.DEFINE_multi_string("notes", [], "Notes carried into --out (what the figures "
                                    "do and do not show).")
_ONLY = flags.DEFINE_list("only", [], "Train only these candidates now (the others are read "
                          "from disk when complete).")
# --report_only, --workdir, --out and --scale are learning_evidence's flags.

RULE = ("Each candidate's score is its best greedy validation success over its RL steps "
        "(steps 1..N; the earliest step reaching it is its step). A candidate whose sampled "
        "trees at that step put more than 10% of nodes at the depth limit, or more than 10% of "
        "helpers outside their root's task, is marked drifting and ranked after those that "
        "are not. Ties go to the lower mean share of nodes at the depth limit, then to the "
        "smaller learning rate.")


def parse_candidates(items) -> dict[str, dict]:
  """["name:recipe", ...] -> {name: recipe dict}; names are folder names."""
  out = {}
  for item in items:
    name, sep, spec = item.partition(":")
    if not sep or not name or not all(ch.isalnum() or ch in "-_." for ch in name):
      raise app.UsageError(f"--candidates {item!r}: use NAME:RECIPE with NAME made of letters, "
                           "digits, '-', '_' or '.', e.g. lam0_lr1e-4:lr=1e-4,lam=0.")
    if name in out:
      raise app.UsageError(f"--candidates: {name!r} given twice.")
    out[name] = rec.parse_recipe(spec)
  return out


def val_stage(src: str, num_tasks: int, step: int | None = None):
  """A greedy check of the checkpoint in `src` (step: newest) on the validation split."""
  def fn(d):
    from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
    r = evaluation.evaluate_checkpoint(src, step=step, num_tasks=num_tasks,
                                       modes=("recursive",), difficulties=("val",), out_dir=d)
    return r["modes"]["recursive"]
  return fn


def curves(rl_dir: str) -> dict:
  """Per step of an RL stage: greedy validation success, sampled success and drift metrics."""
  from rao_jax import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  rows = metrics_lib.read_metrics(os.path.join(rl_dir, "metrics.jsonl"))
  per_step: dict[int, dict] = {}
  for r in rows:
    per_step.setdefault(int(r["step"]), {}).update(r)
  keys = {"val": "eval/success_val", "sampled": "train/success",
          "delegating_sampled": "train/delegating_share", "no_signal": "train/learner/no_signal",
          **{k.split("/", 1)[1]: f"train/{k}" for k in metrics_lib.DRIFT_KEYS}}
  return {"steps": sorted(per_step),
          **{name: [per_step[s].get(key) for s in sorted(per_step)] for name, key in keys.items()}}


def score(cand: dict) -> dict:
  """The candidate's best step and standing under RULE."""
  c = cand["curves"]
  val = [(v, s) for s, v in zip(c["steps"], c["val"]) if v is not None]
  if not val:
    return {"best_step": None, "best_val": None, "drifting": None}
  best = max(v for v, _ in val)
  step = min(s for v, s in val if v == best)
  i = c["steps"].index(step)
  limit = c["at_depth_limit"][i] or 0.0
  outside = c["helpers_outside_root"][i] or 0.0
  depth_mean = [x for x in c["at_depth_limit"] if x is not None]
  return {"best_step": step, "best_val": best, "drifting": bool(limit > 0.1 or outside > 0.1),
          "at_depth_limit_mean": sum(depth_mean) / max(len(depth_mean), 1)}


def choose(cands: dict[str, dict]) -> str | None:
  """The chosen candidate's name under RULE (complete candidates only)."""
  done = {n: c for n, c in cands.items() if c["complete"] and c["score"]["best_val"] is not None}
  if not done:
    return None
  return min(done, key=lambda n: (done[n]["score"]["drifting"], -done[n]["score"]["best_val"],
                                  done[n]["score"]["at_depth_limit_mean"],
                                  float(done[n]["recipe"].get("lr", 0.0))))


def main(argv):
  del argv
  s0 = le.scale_of(rec._SCALES, rec._flag("scale"))  # pylint: disable=protected-access
  if not s0.get("val_tasks"):
    raise app.UsageError(f"--scale={rec._flag('scale')!r} has no validation split; use one "  # pylint: disable=protected-access
                         "with val_tasks (cpu_rao).")
  warm = os.path.abspath(_WARM.value)
  sft_dir = os.path.join(warm, "recursive", "sft")
  if not os.path.exists(os.path.join(sft_dir, "stage.json")):
    raise app.UsageError(f"--warm={warm}: recursive/sft is not complete; run recursion_evidence "
                         f"--scale=cpu_rao --modes=recursive --stop_after=sft --workdir={warm}.")
  root = os.path.abspath(flags.FLAGS.workdir)
  cands = parse_candidates(_CANDIDATES.value)
  if carry.CARRY_OUT.value:
    print(json.dumps(carry_out(sft_dir, root, os.path.abspath(carry.CARRY_OUT.value))))
    return
  if carry.CARRY_IN.value:
    print(json.dumps(carry_in([os.path.abspath(p) for p in carry.CARRY_IN.value], sft_dir, root)))
  stages = le._Stages(root)  # pylint: disable=protected-access
  if not flags.FLAGS.report_only:
    stages.run("val_before", val_stage(sft_dir, s0["val_tasks"]))
    for name, recipe in cands.items():
      if _ONLY.value and name not in _ONLY.value:
        continue
      s = dict(s0, **recipe)
      le._Stages(os.path.join(root, name)).run(  # pylint: disable=protected-access
          "rl", le.rl_stage(rec.rl_config_for("recursive", s), sft_dir))
  out = write(root, s0, cands, os.path.abspath(flags.FLAGS.out), _NOTES.value)
  print(json.dumps({k: out[k] for k in ("val_before", "chosen")} | {
      "scores": {n: c["score"] for n, c in out["candidates"].items()}}))


def carry_out(sft_dir: str, root: str, dest: str, fingerprint=None) -> dict:
  """What a later session needs to go on (experiments/carry.py): stage markers, metrics, run
  configs and each unfinished candidate's newest checkpoint, with the warm start's fingerprint."""
  return carry.carry_out({"recursive": sft_dir}, root, dest,
                         fingerprint or rec.weights_fingerprint)


def carry_in(src, sft_dir: str, root: str, fingerprint=None) -> dict:
  """Restores a carry_out folder (or the first of several that matches) into `root` when the
  warm start in `sft_dir` is the same."""
  return carry.carry_in(src, {"recursive": sft_dir}, root, fingerprint or rec.weights_fingerprint)


def write(root: str, s0: dict, cands: dict[str, dict], out: str, notes=()) -> dict:
  """The recipe JSON from the stages on disk (incomplete candidates are listed as such)."""
  def marker(path):
    try:
      with open(os.path.join(path, "stage.json")) as f:
        return json.load(f)
    except FileNotFoundError:
      return None

  before = marker(os.path.join(root, "val_before"))
  val0 = before["result"]["val"]["success"] if before else None
  result = {"scale": s0, "rule": RULE, "val_before": val0,
            "val_tasks": s0["val_tasks"], "candidates": {}}
  for name, recipe in cands.items():
    rl_dir = os.path.join(root, name, "rl")
    m = marker(rl_dir)
    cand = {"recipe": recipe, "complete": m is not None,
            "minutes": m["minutes"] if m else None,
            "curves": curves(rl_dir) if os.path.exists(os.path.join(rl_dir, "metrics.jsonl"))
                      else {"steps": [], "val": [], "at_depth_limit": [],
                            "helpers_outside_root": []}}
    cand["score"] = score(cand)
    result["candidates"][name] = cand
  result["chosen"] = choose(result["candidates"])
  result["notes"] = list(notes)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
  os.replace(out + ".tmp", out)
  return result


if __name__ == "__main__":
  flags.FLAGS.set_default("out", "benchmarks/results/recursion_recipe.json")
  flags.FLAGS.set_default("workdir", "runs/rao/recipe")
  flags.FLAGS.set_default("scale", "cpu_rao")
  app.run(main)
