"""benchmarks/bench_eval.py reading a run from the experiment's own evaluation stage
(--from_stage), through its command line: what it refuses and what it records."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_eval.py"),
                         *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def _stage(d, workdir, num_tasks=2, minutes=7.5):
  os.makedirs(d)
  with open(os.path.join(d, "stage.json"), "w") as f:
    json.dump({"minutes": minutes, "result": {}}, f)
  with open(os.path.join(d, "results.json"), "w") as f:
    json.dump({"workdir": workdir, "num_tasks": num_tasks, "warmup_s": 3.0, "modes": {
        "recursive": {"medium": {"success": 0.5, "num_tasks": num_tasks,
                                 "per_task": {"t0": 1.0, "t1": 0.0}}}}}, f)
  open(os.path.join(d, "trees.jsonl"), "w").close()


def test_from_stage_records_the_stage_and_refuses_another_warm_start(tmp_path):
  warm = tmp_path / "warm"
  ckpt = warm / "recursive" / "sft"
  os.makedirs(ckpt / "checkpoints")
  out = str(tmp_path / "bench_eval.json")
  with open(out, "w") as f:
    json.dump({"runs": {"old": {"label": "old", "minutes": 15.0, "kept_turns": {},
                                "per_task": {"medium/t0": 1.0, "medium/t1": 1.0}}}}, f)
  common = [f"--eval_workdir={warm}", f"--eval_out={out}", "--num_tasks=2"]

  _stage(str(tmp_path / "other"), str(tmp_path / "elsewhere" / "sft"))
  r = _bench(*common, "--eval_label=new", f"--from_stage={tmp_path / 'other'}")
  assert r.returncode != 0 and "not this warm start" in r.stderr
  r = _bench(*common, "--eval_label=new", f"--from_stage={tmp_path / 'missing'}")
  assert r.returncode != 0 and "not a complete evaluation stage" in r.stderr

  _stage(str(tmp_path / "mine"), str(ckpt))
  r = _bench(*common, "--eval_label=new", f"--from_stage={tmp_path / 'mine'}", "--compare=old")
  assert r.returncode == 0, r.stderr
  line = json.loads(r.stdout.strip().splitlines()[-1])
  assert line["minutes"] == 7.5 and line["success"] == {"medium": 0.5}
  assert line["vs"]["success_changed"] == ["medium/t1"] and line["vs"]["minutes_ratio"] == 0.5
  with open(out) as f:
    runs = json.load(f)["runs"]
  assert set(runs) == {"old", "new"} and runs["new"]["per_task"]["medium/t0"] == 1.0
