"""A run's portable state, carried from one session to the next through the repository.

The runs' folders are not kept between sessions, and a warm start (a full-parameter SFT of
SmolLM2-135M, ~0.5 GB) is rebuilt in each by the same command. What a later session needs to go
on is small: the stage markers (`stage.json`, each with its stage's result), metrics, run configs,
and the checkpoints (LoRA adapters with their optimizer state) an unfinished stage resumes from
or a pending evaluation reads. `carry_out` copies those, with the weights fingerprint of each warm
start they were trained from; `carry_in` restores them only onto warm starts with the same
fingerprints, since an adapter trained on other weights means nothing on these.

The same command gives the same weights on CPUs of one kind, not across kinds: XLA's CPU
kernels take different paths by instruction set (AVX2 against AVX-512), and a full SFT ends a
few ulps apart. So a warm start can have several committed records, one per CPU kind
(`recursion_runs/warm`, `recursion_runs/warm_<sha8>`); `carry_in` takes them all and restores
the one whose fingerprints match, and each manifest names the CPU it was made on.

Symlinked stage folders (a seed's warm-start stages, linked from the warm start's workdir) are
not descended: they belong to the warm start's own carry.
"""
import json
import os
import shutil
from typing import Callable, Mapping, Sequence

from absl import app
from absl import flags

# The experiments' flags (recursion_evidence, recursion_recipe).
CARRY_OUT = flags.DEFINE_string(
    "carry_out", None, "Copy what a later session needs to go on (stage markers, metrics, run "
    "configs, the checkpoints an unfinished RL stage resumes from and a pending held-out "
    "evaluation reads) to this folder, with the warm starts' weights fingerprints, and stop.")
CARRY_IN = flags.DEFINE_list(
    "carry_in", None, "Restore a --carry_out folder into --workdir first. The warm start is "
    "rebuilt by the same command, and the carry is refused unless its weights have the "
    "fingerprints the carry names. Several folders (comma-separated; a warm start's records "
    "from CPUs of different kinds): the one whose fingerprints match is restored.")

# The files of a stage folder a later session reads (trees and HTML pages are rebuilt, or read
# from the committed JSON).
CARRIED = ("stage.json", "metrics.jsonl", "config.json")


def cpu_signature() -> dict:
  """The CPU a run's numbers come from: its model name and the instruction sets that change
  XLA's kernels (and so the weights a warm start ends with)."""
  from rao_jax.kernels import mkl  # pylint: disable=g-import-not-at-top
  return mkl.cpu_kind()


def checkpoint_steps(ckpt_dir: str) -> list[int]:
  return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(
      ckpt_dir) else []


def carry_out(sft_dirs: Mapping[str, str], root: str, dest: str, fingerprint: Callable,
              pending: Callable[[str], int | None] = lambda stage_dir: None) -> dict:
  """Copies the portable state of the stages under `root` to `dest`; returns the manifest.

  sft_dirs: {name: warm-start checkpoint folder} whose fingerprints the manifest records.
  pending(stage_dir): the checkpoint step a not-yet-run evaluation of a stage will read (None:
    none). An unfinished stage also keeps its newest checkpoint, to resume from.
  """
  manifest = {"warm_sha256": {k: fingerprint(v) for k, v in sft_dirs.items()},
              "cpu": cpu_signature(), "files": []}
  for dirpath, dirnames, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    if os.path.basename(dirpath) == "checkpoints":
      dirnames[:] = []
      stage_dir = os.path.dirname(dirpath)
      steps = checkpoint_steps(dirpath)
      keep = set()
      if steps and not os.path.exists(os.path.join(stage_dir, "stage.json")):
        keep.add(steps[-1])
      wanted = pending(stage_dir)
      if wanted is not None:
        keep.add(int(wanted))
      for step in sorted(keep & set(steps)):
        shutil.copytree(os.path.join(dirpath, str(step)), os.path.join(dest, rel, str(step)),
                        dirs_exist_ok=True)
        manifest["files"].append(os.path.join(rel, str(step)) + "/")
      continue
    for name in filenames:
      if name in CARRIED:
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        shutil.copy2(os.path.join(dirpath, name), os.path.join(dest, rel, name))
        manifest["files"].append(os.path.normpath(os.path.join(rel, name)))
  os.makedirs(dest, exist_ok=True)
  with open(os.path.join(dest, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
  return manifest


def _manifest(src: str) -> tuple[dict, dict]:
  with open(os.path.join(src, "manifest.json")) as f:
    manifest = json.load(f)
  want = manifest["warm_sha256"]
  if isinstance(want, str):   # the recipe's first manifests named one warm start
    want = {"recursive": want}
  return manifest, want


def carry_in(srcs: str | Sequence[str], sft_dirs: Mapping[str, str], root: str,
             fingerprint: Callable) -> dict:
  """Restores a carry_out folder into `root` when every warm start its manifest names has the
  same weights here (`sft_dirs`, {name: checkpoint folder}); of several folders (`srcs`), the
  first that matches. A stage this run already completed keeps its own files; any other carried
  file replaces what `root` has, so a carried stage marker wins over a partial run of the same
  stage."""
  srcs = [srcs] if isinstance(srcs, str) else list(srcs)
  mine, refused = {}, []
  for src in srcs:
    manifest, want = _manifest(src)
    # A run of some of the modes (--modes=recursive) restores those modes' stages: the others'
    # warm starts are neither built nor checked, and their files are left out.
    skipped = sorted(set(want) - set(sft_dirs))
    want = {k: v for k, v in want.items() if k in sft_dirs}
    if not want:
      raise app.UsageError(f"carry_in {src}: its stages ran on the warm starts {skipped}, "
                           f"and this run builds none of them (it has {sorted(sft_dirs)}).")
    mine.update({k: fingerprint(sft_dirs[k]) for k in want if k not in mine})
    bad = [k for k in want if mine[k] != want[k]]
    if not bad:
      break
    cpu = manifest.get("cpu")
    made_on = (f"made on {cpu['model']} ({', '.join(cpu['isa'])})" if cpu
               else "its manifest names no CPU")
    refused.append(f"{src} ran on {', '.join(f'{k} {want[k][:8]}' for k in bad)}, {made_on}")
  else:
    here = cpu_signature()
    raise app.UsageError(
        f"carry_in: no folder matches this run's warm start "
        f"({', '.join(f'{k} {v[:8]}' for k, v in mine.items())}, made here on {here['model']} "
        f"({', '.join(here['isa'])})): {'; '.join(refused)}. Adapters and evaluations of other "
        "weights are not comparable. The same command gives other weights on a CPU of another "
        "kind (XLA's kernels differ by instruction set): run the stages again here without "
        "the carry, and carry them out to a folder of their own.")
  files = [rel for rel in manifest["files"] if rel.split("/", 1)[0] not in skipped]
  # Stages this run completed itself keep their own files (decided before anything is copied).
  own = {_stage_of(os.path.join(root, rel)) for rel in files}
  own = {d for d in own if os.path.exists(os.path.join(d, "stage.json"))}
  restored = kept = 0
  for rel in files:
    a, b = os.path.join(src, rel), os.path.join(root, rel)
    if _stage_of(b) in own and os.path.exists(b.rstrip("/")):
      kept += 1
      continue
    if rel.endswith("/"):
      shutil.copytree(a, b, dirs_exist_ok=True)
    else:
      os.makedirs(os.path.dirname(b), exist_ok=True)
      shutil.copy2(a, b)
    restored += 1
  return {"restored": restored, "kept_own": kept, "warm_sha256": {k: mine[k] for k in want},
          "from": src, "modes_left_out": skipped}


def _stage_of(path: str) -> str:
  """The stage folder of a carried path: a file's folder, or a checkpoint's RL stage."""
  d = os.path.dirname(path.rstrip("/"))
  return os.path.dirname(d) if os.path.basename(d) == "checkpoints" else d
