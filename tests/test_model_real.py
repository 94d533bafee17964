"""SmolLM2-135M-Instruct on real weights: parity with transformers, tokenizer, greedy decoding,
and a LoRA adapter exported to PEFT.

The GGUF file is loaded once for the module (dequantizing it takes seconds).
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import ModelConfig, load_pretrained, resolve_model_path, weights
from rao_jax.model import lora as lora_lib
from rao_jax.model import peft as peft_lib
from rao_jax.testing import SMOLLM2_135M_CONFIG

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea, then count to 12."}]

TEXTS = [
    "Hello world", " Hello world", "  leading spaces", "trailing spaces   ", "",
    "The year 2024 had 366 days; 3.14159 is pi, -42 and 1e-5 too.",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "Unicode: café, naïve, Größe, 東京, Привет мир, emoji 🎉🚀, ∑ ∞ → ≤",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "Mixed <|endoftext|> special <repo_name> tokens", "don't I'll we've they're it's",
    "CAPS lock AND MiXeD case", "line1\r\nline2\n\n\nline5", "a" * 300, "!!!???...,,,;;;",
    "https://example.com/path?q=1&r=two#frag", "{\"json\": [1, 2, {\"k\": null}]}",
    "craft(ingredients={'oak_planks': 4}, target=('crafting_table', 1))",
    "await launch_subagent('craft 2 sticks', num_steps=10)",
]


@pytest.fixture(scope="module")
def smollm():
  return load_pretrained("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(smollm):
  _, tok = smollm
  return tok.apply_chat_template(MESSAGES, add_generation_prompt=True)


@pytest.fixture(scope="module")
def our_logits(smollm, prompt_ids):
  model, _ = smollm
  T = len(prompt_ids)
  fwd = nnx.jit(lambda m, t: m.logits(m(t, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32))))
  return np.asarray(fwd(model, jnp.asarray([prompt_ids])))[0]


def test_gguf_metadata_is_the_smollm2_config():
  path = resolve_model_path("smollm2-135m")
  cfg = ModelConfig.from_gguf(path, dtype="float32", param_dtype="float32")
  ref = ModelConfig.from_hf_config(SMOLLM2_135M_CONFIG, dtype="float32", param_dtype="float32")
  assert cfg.replace(rms_eps=ref.rms_eps) == ref
  assert abs(cfg.rms_eps - 1e-5) < 1e-12


def test_runtime_does_not_import_torch():
  code = ("import sys; from rao_jax.model import Tokenizer, ModelConfig, resolve_model_path; "
          "p = resolve_model_path('smollm2-135m'); t = Tokenizer.from_gguf(p); "
          "ModelConfig.from_gguf(p); assert t.encode('hi there') == [6004, 665], t.encode('hi there'); "
          "assert 'torch' not in sys.modules, 'torch was imported'")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     cwd=os.path.dirname(os.path.dirname(__file__)))
  assert r.returncode == 0, r.stderr[-2000:]


def test_tokenizer_ids_equal_transformers(smollm):
  _, tok = smollm
  from transformers import AutoTokenizer
  path = resolve_model_path("smollm2-135m")
  ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  for text in TEXTS:
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert tok.decode(tok.encode(text)) == text
  for messages in (MESSAGES, [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": "4"},
                              {"role": "user", "content": "And 3+3?"}]):
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    theirs = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
  # Known, deliberate difference: transformers' GGUF tokenizer drops SmolLM2's individual-digits
  # pre-tokenizer (its tokenizer.json has Digits(individual_digits=True); llama.cpp's "smollm" splits
  # on \p{N} too). On ASCII digits the ids agree (the vocabulary has no digit merges; see the
  # year/pi text above); on other numeric characters such as "½" ours follow the original.
  assert tok.hf.convert_ids_to_tokens(tok.encode(" ½")) == ["Ġ", "Â½"]
  assert tok.eos_token_id == 2 and tok.stop_token_ids == [2]   # <|im_end|>
  assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"


def test_logits_match_transformers_loading_the_same_gguf(smollm, prompt_ids, our_logits):
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM
  path = resolve_model_path("smollm2-135m")
  hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                            gguf_file=os.path.basename(path),
                                            dtype=torch.float32)
  hf.eval()
  with torch.no_grad():
    ref = hf(torch.tensor([prompt_ids])).logits[0].float().numpy()
  assert ref.shape == our_logits.shape
  diff = np.abs(ref - our_logits).max(axis=-1)
  assert diff.max() <= 1e-3, f"max |logit diff| {diff.max():.2e} at position {diff.argmax()}"
  np.testing.assert_array_equal(ref.argmax(-1), our_logits.argmax(-1))


def test_export_hf_loads_in_transformers_and_in_rao_jax(smollm, prompt_ids, our_logits,
                                                        tmp_path):
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM, AutoTokenizer
  model, tok = smollm
  out = weights.export_hf(model, model.cfg, tok, str(tmp_path / "hf"))
  hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  with torch.no_grad():
    ref = hf(torch.tensor([prompt_ids])).logits[0].numpy()
  assert np.abs(ref - our_logits).max() <= 1e-3
  hf_tok = AutoTokenizer.from_pretrained(out)
  assert hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                    tokenize=False) == tok.decode(prompt_ids)
  again, tok2 = load_pretrained(out, dtype="float32")
  T = len(prompt_ids)
  fwd = nnx.jit(lambda m, t: m.logits(m(t, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32))))
  np.testing.assert_array_equal(np.asarray(fwd(again, jnp.asarray([prompt_ids])))[0],
                                our_logits)
  assert tok2.encode(TEXTS[7]) == tok.encode(TEXTS[7])


def test_greedy_decoding_says_paris(smollm):
  from rao_jax.model.chat import generate
  model, tok = smollm
  reply = generate(model, tok, "What is the capital of France?", max_new_tokens=24)
  assert "Paris" in reply, reply


def test_our_adapter_on_smollm2_gives_peft_our_logits(smollm, tmp_path):
  """A rank-8 adapter (alpha 16, every target, nonzero B) on the real weights, saved in PEFT's
  format and loaded by peft's PeftModel onto transformers' SmolLM2: its logits on prompts the
  adapter never saw equal ours. The adapter moves the logits ~100x the tolerance, so a wrong
  scale or a transposed factor fails (k/v, gate/up and down are not square)."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  from transformers import AutoModelForCausalLM
  model, tok = smollm
  base = weights.export_hf(model, model.cfg, tok, str(tmp_path / "base"))
  adapted, _ = load_pretrained(base, dtype="float32")
  lora_lib.add_adapters(adapted, {"rank": 8, "alpha": 16.0, "targets": lora_lib.TARGETS})
  rng = np.random.default_rng(3)
  for name, var in vars(adapted.lora).items():
    if name.endswith("_b"):
      var[...] = jnp.asarray(rng.normal(0, 0.02, var.shape), jnp.float32)
  out = peft_lib.save_adapter(adapted, str(tmp_path / "adapter"), base_model=base)
  prompts = [tok.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
             for text in ("Craft 2 oak planks, then a stick.", "What is 17 times 3?")]
  with torch.no_grad():
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    plain = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
    policy = peft.PeftModel.from_pretrained(hf, out).eval()
    theirs = [policy(torch.tensor([p])).logits[0].numpy() for p in prompts]
  for p, ref, before in zip(prompts, theirs, plain):
    T = len(p)
    ours = np.asarray(adapted.logits(adapted(jnp.asarray([p]), jnp.arange(T)[None],
                                             jnp.ones((1, T), jnp.int32))))[0]
    assert np.abs(ref - before).max() > 0.1, "the adapter barely changes the logits"
    assert np.abs(ours - ref).max() <= 1e-3, np.abs(ours - ref).max()
