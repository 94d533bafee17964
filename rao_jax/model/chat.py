"""Chat with a model from the command line: greedy decoding through the KV cache.

    python -m rao_jax.model.chat --model smollm2-135m --prompt "What is the capital of France?"
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rao_jax.model.weights import load_pretrained


# Pure functions of model.inference_params() (per-layer weights), as the rollout engine runs
# them: slicing the stacked weights inside a per-token step would copy the model each token.
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(fns, params, cache, tokens_1xT):
  T = tokens_1xT.shape[1]
  hidden, cache = fns(params, tokens_1xT, jnp.arange(T)[None], cache,
                      jnp.zeros((1,), jnp.int32))
  return jnp.argmax(fns.logits(params, hidden[:, -1]), axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode(fns, params, cache, token_1, index):
  hidden, cache = fns(params, token_1[:, None], index[None, None], cache, index[None])
  return jnp.argmax(fns.logits(params, hidden[:, -1]), axis=-1).astype(jnp.int32), cache


def generate_ids(model, prompt_ids: list[int], max_new_tokens: int,
                 stop_ids: tuple[int, ...] = ()) -> list[int]:
  """Greedy continuation of ``prompt_ids`` (stops after a stop id, which is included)."""
  T = len(prompt_ids)
  S = -(-(T + max_new_tokens) // 64) * 64   # bucketed cache length: few recompiles
  fns, params = model.inference_fns(), model.inference_params()
  cache = model.init_cache(1, S)
  token, cache = _prefill(fns, params, cache, jnp.asarray([prompt_ids], jnp.int32))
  out = [int(token[0])]
  for i in range(max_new_tokens - 1):
    if out[-1] in stop_ids:
      break
    token, cache = _decode(fns, params, cache, token, jnp.asarray(T + i, jnp.int32))
    out.append(int(token[0]))
  return out


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64,
             system: str | None = None) -> str:
  """The model's greedy reply to one user message, formatted with the chat template."""
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": prompt}]
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  out = generate_ids(model, ids, max_new_tokens, tuple(tokenizer.stop_token_ids))
  return tokenizer.decode(out, skip_special_tokens=True).strip()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2-135m",
                      help="registry name, .gguf file or HF checkpoint folder")
  parser.add_argument("--prompt", default="What is the capital of France?")
  parser.add_argument("--system", default=None, help="optional system message")
  parser.add_argument("--max-new-tokens", type=int, default=96)
  parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: by backend)")
  args = parser.parse_args(argv)
  t0 = time.time()
  try:
    model, tokenizer = load_pretrained(args.model, dtype=args.dtype)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  t1 = time.time()
  reply = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.system)
  t2 = time.time()
  print(f"[{args.model} on {jax.default_backend()}: loaded in {t1 - t0:.1f}s, "
        f"replied in {t2 - t1:.1f}s]", file=sys.stderr)
  print(f"user: {args.prompt}")
  print(f"assistant: {reply}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
