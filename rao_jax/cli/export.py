r"""Export a training run's policy for other tools: a PEFT LoRA adapter or a Hugging Face folder.

  rao-export --workdir=RUN --out=DIR [--step=N]      # LoRA run: PEFT adapter folder
  rao-export --workdir=RUN --out=DIR --merge         # HF folder, the adapter merged in
  rao-export --workdir=RUN --out=DIR --base_out=BASE # adapter, and its base as an HF folder
  rao-export --workdir=RUN --out=DIR                 # full fine-tuning run: HF folder

A LoRA run's checkpoint holds only the adapter; by default DIR becomes a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors, base_model_name_or_path = the run's
model.name, or the run its ckpt.init_from names: the weights it adapted) that
`peft.PeftModel.from_pretrained(base, DIR)` loads (PEFT's format, the one vLLM's and SGLang's
LoRA loaders read too) and `rao_jax.model.peft.load_adapter` reads back.
PEFT needs the base as an HF folder with the very weights the run trained on: when model.name
is a registry name or a GGUF file (dequantized weights, not the hub's), or another run
(ckpt.init_from), --base_out=BASE writes that base as an HF folder and the adapter names it.
--merge writes one HF folder (config, safetensors, tokenizer) with W + (alpha / r) A B in place
of each adapted weight: any transformers or SGLang user loads it as a plain model. A full
fine-tuning run always exports an HF folder; --merge is accepted there and changes nothing (the
weights are the whole model already).

--dtype sets the stored tensors' dtype (default: the run's parameter dtype). Files are written
atomically one by one; DIR may exist, but not with an export of the other kind in it. Prints a
JSON summary line. `python -m rao_jax.cli.export` is the same command.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

from absl import app
from absl import flags
from absl import logging

from rao_jax.cli import common


def _is_hf_folder(name: str) -> bool:
  return os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json"))


def _check_out(out: str, kind: str) -> None:
  """Refuses an ``out`` that already holds an export of the other kind (a folder holding both
  an adapter and a full model is ambiguous to loaders such as AutoPeftModel)."""
  if kind == "adapter":
    clash = (glob.glob(os.path.join(out, "model*.safetensors"))
             + glob.glob(os.path.join(out, "pytorch_model*.bin")))
  else:
    clash = glob.glob(os.path.join(out, "adapter_*"))
  if clash:
    raise ValueError(f"--out={out} already holds {sorted(os.path.basename(c) for c in clash)}, "
                     f"another kind of export than the {kind} being written; choose an empty "
                     "folder or remove them.")


def export_run(workdir: str, out: str, step: int | None = None, merge: bool = False,
               dtype: str | None = None, base_out: str | None = None) -> dict[str, Any]:
  """Exports a run's checkpoint ``step``; see the module docstring for what goes where.

  Args:
    workdir: the training run directory (config.json and checkpoints/).
    out: the output folder (created).
    step: the checkpoint step; None = the newest.
    merge: for a LoRA run, write an HF folder with the adapter merged instead of the adapter.
    dtype: stored tensor dtype (float32, bfloat16, float16); None = the parameter dtype.
    base_out: for a LoRA run's adapter export, also write the base model as an HF folder here
      (and name it as the adapter's base_model_name_or_path).

  Returns:
    {"workdir", "step", "out", "kind" ("adapter", "merged" or "full"), "base_model",
    "bytes" (of the tensors written to ``out``)}.

  Raises:
    ValueError: ``base_out`` with a merged or full export; ``out`` holds another kind of export.
  """
  # Imported here: `--help` and flag errors should not wait for JAX and the model code.
  from rao_jax.model import load_pretrained, peft  # pylint: disable=g-import-not-at-top
  from rao_jax.model.weights import export_hf  # pylint: disable=g-import-not-at-top
  from rao_jax.rollout.serve import loading  # pylint: disable=g-import-not-at-top
  workdir = os.path.abspath(workdir)
  name, run_dtype = loading.run_model_name(workdir)
  lora = loading.run_lora(workdir)
  is_lora = bool(lora) and int(lora.get("rank") or 0) > 0
  kind = "adapter" if is_lora and not merge else ("merged" if is_lora else "full")
  if base_out and kind != "adapter":
    raise ValueError(f"--base_out={base_out} goes with a LoRA run's adapter export; this "
                     f"export is a {kind} HF folder, which needs no separate base.")
  if merge and not is_lora:
    logging.info("--merge: %s is a full fine-tuning run; its HF folder is the whole model "
                 "already", workdir)
  _check_out(out, kind)
  # A LoRA run started from another run's checkpoint (ckpt.init_from) adapted THAT run's
  # weights: they are its base, not model.name's.
  init_from = loading.run_init_from(workdir) if is_lora else ""
  base = os.path.abspath(init_from) if init_from else name
  if base_out:
    # The base first and dropped before the run's model loads: one model in memory at a time.
    if init_from:
      base_model, base_tok, _ = loading.load_run_checkpoint(init_from)
    else:
      base_model, base_tok = load_pretrained(
          name, dtype=None if run_dtype == "auto" else run_dtype)
    export_hf(base_model, None, base_tok, base_out, dtype)
    del base_model
    base = os.path.abspath(base_out)
  elif kind == "adapter" and not _is_hf_folder(base):
    logging.warning("the run's base %r is not an HF folder; PEFT needs one with the same "
                    "weights: rerun with --base_out=DIR to write it, or --merge for a whole "
                    "model%s", base, " (rao-evaluate --workdir=<that run> --adapter=<this "
                    "folder> evaluates it as it is)" if init_from else "")
  model, tokenizer, step = loading.load_run_checkpoint(workdir, step)
  os.makedirs(out, exist_ok=True)
  if kind == "adapter":
    peft.save_adapter(model, out, base_model=base, dtype=dtype)
    written = os.path.join(out, peft.WEIGHTS_FILE)
  else:
    export_hf(model, None, tokenizer, out, dtype)
    written = os.path.join(out, "model.safetensors")
  return {"workdir": workdir, "step": step, "out": os.path.abspath(out), "kind": kind,
          "base_model": base, "bytes": os.path.getsize(written)}


def _define_flags() -> dict[str, Any]:
  # Defined when the command runs, not at import: tests call export_run in a process whose
  # other modules define --workdir too, and absl refuses a flag defined twice.
  return {
      "workdir": flags.DEFINE_string("workdir", None, "The training run directory."),
      "out": flags.DEFINE_string("out", None, "The output folder."),
      "step": flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest)."),
      "merge": flags.DEFINE_bool(
          "merge", False, "LoRA run: write an HF folder with the adapter merged into the "
          "weights instead of the PEFT adapter (full fine-tuning run: no effect)."),
      "dtype": flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                                 "Stored tensor dtype (default: the run's parameter dtype)."),
      "base_out": flags.DEFINE_string(
          "base_out", None, "LoRA adapter export: also write the run's base model as an HF "
          "folder here, and name it as the adapter's base."),
  }


def run() -> None:
  """The `rao-export` command."""
  f = _define_flags()
  flags.mark_flags_as_required(["workdir", "out"])

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}; see --help.")
    try:
      summary = export_run(f["workdir"].value, f["out"].value, f["step"].value,
                           f["merge"].value, f["dtype"].value, f["base_out"].value)
    except (ValueError, FileNotFoundError) as e:
      # The message names the bad value and the fix; a traceback would only bury it.
      raise SystemExit(f"rao-export: {e}") from e
    print(json.dumps(summary))

  common.run(main, __doc__)


if __name__ == "__main__":
  run()
