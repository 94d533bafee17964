"""serve's command line: model source, HTTP options, and the engine flags, generated from
``EngineConfig``'s fields so the engine has one set of defaults (EngineConfig's).

    python -m rao_jax.rollout.serve --model smollm2-135m --port 30000
    python -m rao_jax.rollout.serve --checkpoint runs/x [--step N]    # a training run's weights
    python -m rao_jax.rollout.serve --tiny --num-slots 4 --chunk-sizes 16,64
    RAO_JAX_API_KEY=... python -m rao_jax.rollout.serve --host 0.0.0.0 --weight-roots runs
    python -m rao_jax.rollout.serve --model smollm2-135m --max-lora-rank 8   # a LoRA run's servers
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import typing

from rao_jax.rollout import EngineConfig
from rao_jax.rollout.serve import door

log = logging.getLogger(__name__)

# EngineConfig fields serve sets itself: the stops come from the tokenizer.
_NOT_FLAGS = ("default_stop_token_ids",)


def _field_docs() -> dict[str, str]:
  """EngineConfig's ``Attributes:`` docstring entries, field -> text (the flags' help)."""
  doc = EngineConfig.__doc__ or ""
  docs, name = {}, None
  for line in doc.split("Attributes:", 1)[-1].splitlines():
    m = re.match(r"^    (\w+): (.*)$", line)
    if m:
      name, docs[m.group(1)] = m.group(1), m.group(2).strip()
    elif name and line.startswith("      "):
      docs[name] += " " + line.strip()
  return {k: v.replace("%", "%%") for k, v in docs.items()}


def _int_tuple(s: str) -> tuple[int, ...]:
  """``"16,64,256"`` -> (16, 64, 256); ``""`` -> () (EngineConfig derives the buckets)."""
  try:
    return tuple(int(x) for x in s.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers, e.g. 16,64"
                                     ) from None


def _folders(s: str) -> tuple[str, ...]:
  """``"a,b"`` -> ("a", "b"); at least one folder."""
  out = tuple(x.strip() for x in s.split(",") if x.strip())
  if not out:
    raise argparse.ArgumentTypeError(f"{s!r}: give one or more folders, e.g. runs,/data/ckpts")
  return out


def weight_roots(args: argparse.Namespace) -> tuple[str, ...]:
  """The folders weight loads may read: ``--weight-roots``, else the working directory plus
  the served run (``--checkpoint``) or model folder (``--model`` DIR, or a file's folder), the
  places a trainer's exports (``<workdir>/weights``) and reloads of the model live."""
  if args.weight_roots:
    return tuple(args.weight_roots)
  roots = [os.getcwd()]
  if args.checkpoint:
    roots.append(args.checkpoint)
  elif args.model and os.path.isdir(args.model):
    roots.append(args.model)
  elif args.model and os.path.isfile(args.model):
    roots.append(os.path.dirname(os.path.abspath(args.model)))
  return tuple(roots)


def adapter_slot_config(args: argparse.Namespace, model_lora):
  """The LoraConfig of the served adapter slot, or None for a server without one.

  Args:
    args: parsed flags (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``,
      ``--lora-alpha``).
    model_lora: the loaded model's LoraConfig (a LoRA run's checkpoint has an adapter: it is
      the slot, and the flags must agree with it).

  Raises:
    ValueError: flags that contradict each other or the checkpoint's adapter, naming the fix.
  """
  from rao_jax.model import lora as lora_lib
  from rao_jax.rollout.serve.adapters import parse_target_modules
  targets = parse_target_modules(args.lora_target_modules)
  if model_lora.enabled:
    want = {"--max-lora-rank": (args.max_lora_rank, model_lora.rank),
            "--lora-alpha": (args.lora_alpha, model_lora.alpha)}
    for flag, (given, have) in want.items():
      if given is not None and given != have:
        raise ValueError(f"{flag} {given}: the served checkpoint's adapter has {have}, and it "
                         "is the server's adapter slot; drop the flag or give its value.")
    if args.lora_target_modules != "all" and set(targets) != set(model_lora.targets):
      raise ValueError(f"--lora-target-modules {args.lora_target_modules}: the served "
                       f"checkpoint's adapter targets {list(model_lora.targets)}; drop the flag.")
    return model_lora
  if args.max_lora_rank is None:
    if args.enable_lora:
      raise ValueError("--enable-lora needs --max-lora-rank R: the rank of the adapter slot "
                       "(adapters of rank <= R load).")
    return None
  if args.max_lora_rank < 1:
    raise ValueError(f"--max-lora-rank {args.max_lora_rank}: give a rank >= 1.")
  alpha = args.lora_alpha if args.lora_alpha is not None else lora_lib.LoraConfig.alpha
  return lora_lib.LoraConfig(rank=args.max_lora_rank, alpha=alpha, targets=targets)


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
  """Adds ``--num-slots``, ``--max-len``, ... one flag per EngineConfig field.

  Int fields take an int, tuple fields a comma-separated list (empty: derived); the default
  and the help are the field's.

  Args:
    ap: the parser to extend.
  """
  hints = typing.get_type_hints(EngineConfig)
  docs = _field_docs()
  group = ap.add_argument_group("engine (EngineConfig fields)")
  for f in dataclasses.fields(EngineConfig):
    if f.name in _NOT_FLAGS:
      continue
    flag = "--" + f.name.replace("_", "-")
    tp = hints[f.name]
    if tp is int:
      kind, shown = int, str(f.default)
    elif typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is int:
      kind, shown = _int_tuple, ",".join(map(str, f.default)) or "derived"
    else:
      raise TypeError(f"EngineConfig.{f.name}: type {tp} has no command-line form; add one "
                      "to rao_jax/rollout/serve/cli.py.")
    group.add_argument(flag, type=kind, default=f.default, dest=f.name,
                       help=f"{docs.get(f.name, '')} (default: {shown})")


def engine_config(args: argparse.Namespace, **fields) -> EngineConfig:
  """The EngineConfig of parsed engine flags (``fields`` set the others, e.g. the stops).

  Args:
    args: parsed flags (``add_engine_flags``).
    **fields: EngineConfig fields without a flag.

  Returns:
    The validated EngineConfig.
  """
  values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name not in _NOT_FLAGS}
  return EngineConfig(**values, **fields)


def parser() -> argparse.ArgumentParser:
  """serve's argument parser."""
  ap = argparse.ArgumentParser(
      prog="python -m rao_jax.rollout.serve",
      description="An SGLang- and OpenAI-compatible HTTP server over the embedded JAX engine.")
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--model", default=None,
                   help="registry name, .gguf file or HF folder (load_pretrained); default "
                        "smollm2-135m")
  src.add_argument("--checkpoint", default=None,
                   help="a training run directory (has config.json and checkpoints/): serves "
                        "its newest checkpoint (or --step)")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step with --checkpoint")
  ap.add_argument("--tiny", action="store_true",
                  help="serve a tiny random model of --model's architecture, with its "
                       "tokenizer (tests, smoke runs)")
  ap.add_argument("--host", default="127.0.0.1",
                  help="address to bind; one other machines can reach needs --api-key (or "
                       "--allow-no-api-key)")
  ap.add_argument("--port", type=int, default=30000)
  ap.add_argument("--api-key", default=None,
                  help="require 'Authorization: Bearer KEY' on every route but /health and "
                       "/health_generate (SGLang's flag; 401 otherwise). Default: the "
                       f"{door.API_KEY_ENV} environment variable, which keeps the key out of "
                       "process listings")
  ap.add_argument("--allow-no-api-key", action="store_true",
                  help="serve a non-loopback --host without a key (anyone reaching the port "
                       "can generate and load weights)")
  ap.add_argument("--weight-roots", type=_folders, default=None,
                  help="comma-separated folders /update_weights_from_disk and "
                       "/load_lora_adapter may load from "
                       "(symlinks and .. resolved; 403 outside them). Default: the working "
                       "directory, plus the --checkpoint run or the --model folder (or the "
                       "folder of a --model file)")
  lora = ap.add_argument_group(
      "LoRA (SGLang's flags; this server applies one adapter at a time, merged into its "
      "weights: /load_lora_adapter replaces it, and requests name it with lora_path)")
  lora.add_argument("--enable-lora", action="store_true",
                    help="give the engine an adapter slot (implied by --max-lora-rank; needs "
                         "it unless --checkpoint serves a LoRA run, whose adapter is the slot)")
  lora.add_argument("--max-lora-rank", type=int, default=None,
                    help="the slot's rank R: adapters of rank <= R load (smaller ones padded "
                         "with zeros)")
  lora.add_argument("--lora-target-modules", default="all",
                    help="comma-separated projections the slot adapts: q_proj, k_proj, v_proj, "
                         "o_proj, gate_proj, up_proj, down_proj, or all (default)")
  lora.add_argument("--lora-alpha", type=float, default=None,
                    help="the slot's alpha (default: model.lora's default, 32); adapters of "
                         "another alpha / rank are rescaled to it (exact when equal)")
  ap.add_argument("--dtype", default=None, help="activation/param dtype (default per backend)")
  ap.add_argument("--warmup", action="store_true", help="compile every shape before serving")
  ap.add_argument("--weight-version", default="default",
                  help="reported until a weight update sets another (SGLang's default)")
  ap.add_argument("--served-model-name", default=None,
                  help="the model id /v1/models reports (default: --model or --checkpoint)")
  ap.add_argument("--preferred-sampling-params", default=None,
                  help="JSON object of sampling_params defaults (SGLang's flag)")
  add_engine_flags(ap)
  return ap


def build_server(argv=None):
  """Parses serve's command line and loads the model: (Server, args), not yet listening.

  Args:
    argv: the arguments (default sys.argv[1:]).

  Returns:
    (Server, parsed args).
  """
  # JAX loads here, after the flags parsed (so --help and flag errors are instant).
  from rao_jax.model import load_pretrained
  from rao_jax.model import lora as lora_lib
  from rao_jax.rollout.serve.adapters import AdapterSlot
  from rao_jax.rollout.serve import loading
  from rao_jax.rollout.serve.schema import BadRequest, parse_sampling
  from rao_jax.rollout.serve.server import Server
  ap = parser()
  args = ap.parse_args(argv)
  # The key leaves the parsed args here, so nothing that prints or reports them (the server's
  # /get_server_info, logs) can show it.
  api_key = args.api_key or os.environ.get(door.API_KEY_ENV) or None
  del args.api_key
  refusal = door.check_bind(args.host, api_key, args.allow_no_api_key)
  if refusal:
    ap.error(refusal)
  if not api_key and not door.is_loopback(args.host):
    log.warning("serving %s without an API key (--allow-no-api-key): anyone who can reach "
                "port %d can generate and load weights.", args.host, args.port)
  roots = weight_roots(args)
  preferred = None
  if args.preferred_sampling_params:
    try:
      preferred = json.loads(args.preferred_sampling_params)
      parse_sampling(preferred, (), True)
    except (ValueError, BadRequest) as e:
      ap.error(f"--preferred-sampling-params: {e}")
  try:
    cfg = engine_config(args)
  except ValueError as e:
    ap.error(str(e))

  if not args.checkpoint:     # flag errors before the model loads (a checkpoint's come after)
    try:
      adapter_slot_config(args, lora_lib.LoraConfig())
    except ValueError as e:
      ap.error(str(e))

  from rao_jax.rollout import EmbeddedEngine
  model_name = args.model or "smollm2-135m"
  if args.checkpoint:
    model, tokenizer, step = loading.load_run_checkpoint(args.checkpoint, args.step, args.dtype)
    model_path = f"{args.checkpoint}@step{step}"
  elif args.tiny:
    model, tokenizer = loading.tiny_model(model_name, args.dtype)
    model_path = model_name
  else:
    model, tokenizer = load_pretrained(model_name, dtype=args.dtype)
    model_path = model_name
  try:
    slot = adapter_slot_config(args, model.cfg.lora)
  except ValueError as e:
    ap.error(str(e))
  if slot is not None and not model.cfg.lora.enabled:
    # A zero adapter (B = 0): the base is served exactly until an adapter loads.
    lora_lib.add_adapters(model, slot)
  cfg = dataclasses.replace(cfg, default_stop_token_ids=loading.stop_ids(tokenizer))
  engine = EmbeddedEngine(model, cfg, weight_version=args.weight_version, tokenizer=tokenizer)
  if args.warmup:
    log.info("warm-up compiled every shape in %.1f s", engine.warmup())
  info = dict(vars(args))
  info["model_type"] = getattr(getattr(model, "cfg", None), "model_type", None)
  info["api_key_required"] = bool(api_key)
  server = Server(engine, tokenizer, model_path=model_path,
                  loader=loading.weights_loader(args.dtype, model.cfg.lora), server_args=info,
                  served_model_name=args.served_model_name or args.checkpoint or model_name,
                  preferred_sampling_params=preferred, api_key=api_key, weight_roots=roots,
                  adapter_slot=AdapterSlot(model) if model.cfg.lora.enabled else None)
  return server, args


def main(argv=None):
  """Runs the server until interrupted."""
  from aiohttp import web
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  server, args = build_server(argv)
  door_note = "API key required" if server.server_args["api_key_required"] else "no API key"
  print(f"rao_jax rollout server on http://{args.host}:{args.port} ({door_note}; weights load "
        f"from {', '.join(server.weight_roots.roots)})", file=sys.stderr, flush=True)
  web.run_app(server.app(), host=args.host, port=args.port, print=None)
