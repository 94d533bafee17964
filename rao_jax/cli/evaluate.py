r"""Evaluate on held-out tasks (recursive and single-agent): a training run's checkpoint, or a
model with no run directory (a baseline before training).

  rao-evaluate --workdir=DIR [--step=N] [--num_tasks=100] \
      [--modes=recursive,single] [--difficulties=medium,hard] [--samples=8]
  rao-evaluate --config=experiments/configs/textcraft.py:recursive \
      --model=smollm2-135m [--samples=8]                     # registry name, HF folder, .gguf
  rao-evaluate --config=experiments/configs/textcraft.py:recursive \
      --server_url=http://host:30000 [--model=TOKENIZER]     # SGLang or rao_jax.rollout.serve
      [--server_api=openai]                                   # any /v1/completions server

Greedy success (with a 95% interval) per mode and difficulty; with --samples=K also K sampled
trees per task (the config's agent temperature) and the unbiased pass@k for k = 1..K. Tasks
come from the environment's held-out "test" split, or from a file: --test_tasks=PATH (the RAO
authors' JSONL format for TextCraft), or a config's env.task_files.test.
Works on any device count: a checkpoint saved on 8 devices restores onto this process's.
Writes results.json, trees.jsonl and trees.html (DIR/evaluation/step_N/ for a run, --out_dir
or ./evaluation/<model> otherwise) and prints a JSON summary. In a checkout,
`python -m experiments.evaluate` is the same command.
"""
import json

from absl import app
from absl import flags
from ml_collections import config_flags

from rao_jax.cli import common

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (has config.json).")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config, for --model / --server_url (no run directory).",
    lock_config=False)
_MODEL = flags.DEFINE_string(
    "model", None, "Evaluate this model without a run directory: a registry name, HF folder "
    "or GGUF file (default: the config's model.name); with --server_url, the tokenizer.")
_SERVER_URL = flags.DEFINE_list(
    "server_url", None, "Server(s) to generate with instead of a local model.")
_SERVER_API = flags.DEFINE_enum(
    "server_api", "sglang", ["sglang", "openai"],
    "sglang: SGLang-native /generate (SGLang, rao_jax.rollout.serve); openai: one "
    "OpenAI-compatible /v1/completions server (vLLM, ...).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", None, "Held-out tasks per difficulty.")
_MODES = flags.DEFINE_list("modes", ["recursive", "single"], "Agent modes to evaluate.")
_DIFFS = flags.DEFINE_list("difficulties", None, "Difficulties (default: the config's).")
_SAMPLES = flags.DEFINE_integer(
    "samples", 0, "Sampled trees per task for pass@k (k = 1..samples); 0 = greedy only.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output folder (default: see above).")
_TEST_TASKS = flags.DEFINE_string(
    "test_tasks", None, "A JSONL task file to evaluate on instead of the held-out split.")
_SET = flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE (JSON value) changing the run's config for this evaluation only, "
    "e.g. --set=env.kwargs.seed=1 (another world) --set=agent.max_depth=8.")


_ADAPTER = flags.DEFINE_string(
    "adapter", None, "A PEFT LoRA adapter folder (rao-export writes one) applied on top of "
    "--workdir's full-parameter checkpoint, e.g. an adapter trained from that run.")


def _overrides(items) -> dict:
  from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
  try:
    return evaluation.parse_overrides(items)
  except ValueError as e:
    raise app.UsageError(f"--set: {e}") from e


def main(argv):
  del argv
  common.init_distributed()
  from rao_jax import evaluation  # pylint: disable=g-import-not-at-top
  files = {"test": _TEST_TASKS.value} if _TEST_TASKS.value else None
  if _WORKDIR.value:
    if _MODEL.value or _SERVER_URL.value:
      raise app.UsageError("--workdir evaluates a run's checkpoint; --model / --server_url "
                           "evaluate without one. Give one of them.")
    res = evaluation.evaluate_checkpoint(_WORKDIR.value, _STEP.value, _NUM_TASKS.value,
                                         _MODES.value, _DIFFS.value, _OUT_DIR.value,
                                         samples=_SAMPLES.value, task_files=files,
                                         overrides=_overrides(_SET.value),
                                         adapter=_ADAPTER.value)
  else:
    if _SET.value or _ADAPTER.value:
      raise app.UsageError("--set and --adapter apply to a run's checkpoint: give them with "
                           "--workdir (with --config, edit the config or merge the adapter "
                           "with rao-export --merge).")
    if _CONFIG.value is None:
      raise app.UsageError("Give --workdir=DIR (a training run), or --config=... with "
                           "--model=NAME or --server_url=URL.")
    res = evaluation.evaluate_model(_CONFIG.value, model=_MODEL.value,
                                    server_urls=_SERVER_URL.value, num_tasks=_NUM_TASKS.value,
                                    modes=_MODES.value, difficulties=_DIFFS.value,
                                    out_dir=_OUT_DIR.value, samples=_SAMPLES.value,
                                    task_files=files, server_api=_SERVER_API.value)
  summary = {m: {d: {k: v[k] for k in ("success", "ci95", "pass_at_k") if k in v}
                 for d, v in per.items()} for m, per in res["modes"].items()}
  print(json.dumps({"step": res["step"], "model": res.get("model"), "out_dir": res["out_dir"],
                    "success": summary}))


def run() -> None:
  """The `rao-evaluate` command."""
  common.run(main, __doc__)


if __name__ == "__main__":
  run()
