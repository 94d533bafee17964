"""Fast property tests of the policy model on tiny random configs derived from the real one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rao_jax.model import (ModelConfig, Transformer, make_packed_inputs, token_logprob_sum,
                           token_logprobs)
from rao_jax.model.config import RopeScaling, UnsupportedModelError, rope_inv_freq
from rao_jax.testing import SMOLLM2_135M_CONFIG, smollm2_config, tiny_config

# Architecture variants: SmolLM2 (Llama, tied), Qwen2 (qkv biases, untied), Qwen3 (QK-norm),
# Llama 3.1 (rope scaling, untied).
VARIANTS = {
    "llama": {},
    "qwen2": dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tie_embeddings=False),
    "qwen3": dict(architecture="Qwen3ForCausalLM", qk_norm=True),
    "llama31": dict(tie_embeddings=False, qkv_bias=True, o_bias=True,
                    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    # Every option at once (each XLA compile costs seconds on CI's 2 cores).
    "all": dict(tie_embeddings=False, qkv_bias=True, o_bias=True, qk_norm=True,
                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
}


def _model(variant="llama", seed=0, **kw):
  cfg = tiny_config(**{**VARIANTS[variant], **kw})
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  # Non-trivial norms and biases so the tests see them.
  for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "bq", "bk", "bv", "bo"):
    if hasattr(model.layers, name):
      var = getattr(model.layers, name)
      noise = jax.random.normal(jax.random.key(hash(name) % 1000), var.shape)
      var.set_value(var[...] + 0.3 * noise)
  return model


@nnx.jit
def _forward(model, tokens, positions, segments):
  return model(tokens, positions, segments)


@nnx.jit
def _logprobs(model, hidden, targets):
  return token_logprobs(model, hidden, targets)


def _tokens(B, T, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, 49152)


def test_tiny_is_derived_from_real_config():
  real = smollm2_config()
  tiny = real.tiny()
  assert tiny.vocab_size == real.vocab_size == 49152
  assert tiny.tie_embeddings and not tiny.qk_norm and not tiny.qkv_bias
  assert tiny.rope_theta == real.rope_theta == 100000.0
  assert tiny.n_heads // tiny.n_kv_heads == real.n_heads // real.n_kv_heads == 3
  assert tiny.n_layers == 2 and tiny.d_model < real.d_model
  assert real.n_params == 134_515_008  # SmolLM2-135M, tied embeddings


def test_hf_config_variants_and_errors():
  q2 = ModelConfig.from_hf_config({**SMOLLM2_135M_CONFIG, "architectures": ["Qwen2ForCausalLM"],
                                   "tie_word_embeddings": False})
  assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm and not q2.tie_embeddings
  q3 = ModelConfig.from_hf_config({**SMOLLM2_135M_CONFIG, "architectures": ["Qwen3ForCausalLM"],
                                   "head_dim": 128})
  assert q3.qk_norm and q3.head_dim == 128 and not q3.qkv_bias
  l3 = ModelConfig.from_hf_config({**SMOLLM2_135M_CONFIG, "rope_scaling": {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})
  assert l3.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
  # Round trip through the exported config.json dict.
  for cfg in (q2, q3, l3, smollm2_config()):
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
  with pytest.raises(UnsupportedModelError, match="MistralForCausalLM.*supported"):
    ModelConfig.from_hf_config({**SMOLLM2_135M_CONFIG, "architectures": ["MistralForCausalLM"]})
  with pytest.raises(UnsupportedModelError, match="yarn"):
    ModelConfig.from_hf_config({**SMOLLM2_135M_CONFIG,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(ValueError, match="n_heads=9 must be a multiple of n_kv_heads=4"):
    smollm2_config(n_kv_heads=4)
  with pytest.raises(ValueError, match="ModelConfig.dtype='fp8'"):
    smollm2_config(dtype="fp8")


def test_llama3_rope_scaling_matches_reference_values():
  # Hand-checked against the Llama 3.1 recipe: high frequencies unchanged, low ones / factor.
  cfg = smollm2_config(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0,
                                                                      8192))
  base = 1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64))
  inv = rope_inv_freq(cfg)
  wavelen = 2 * np.pi / base
  np.testing.assert_allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
  np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)
  mid = (wavelen >= 2048) & (wavelen <= 8192)
  assert np.all(inv[mid] <= base[mid]) and np.all(inv[mid] >= base[mid] / 8)


@pytest.mark.parametrize("variant,extra_rows", [("llama", 0), ("all", 0), ("llama", 2)])
def test_cached_decode_equals_full_forward(variant, extra_rows):
  """extra_rows > 0: the B rows are the first B of a larger cache (the engine decoding its
  first R slots), which attention reads in place."""
  model = _model(variant)
  B, T, S = 3, 12, 20
  tokens = _tokens(B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  full = _forward(model, tokens, pos, jnp.ones((B, T), jnp.int32))
  fwd = nnx.jit(lambda m, t, p, c, w: m.forward_cached(t, p, c, w), donate_argnums=3)
  # Rows are at different lengths: prefill row b with P_b tokens (padded to 7), then decode.
  P = np.array([7, 4, 5])
  cache = jax.tree.map(lambda x: x.at[B:].set(7.0), model.init_cache(B + extra_rows, S))
  pre_tok = jnp.where(jnp.arange(7)[None] < P[:, None], tokens[:, :7], 0)
  h, cache = fwd(model, pre_tok, pos[:, :7], cache, jnp.zeros(B, jnp.int32))
  for b in range(B):
    np.testing.assert_allclose(h[b, :P[b]], full[b, :P[b]], atol=1e-4, rtol=0)
  got = [[h[b, i] for i in range(P[b])] for b in range(B)]
  w = P.copy()
  while min(w) < T:
    t = tokens[np.arange(B), np.minimum(w, T - 1)][:, None]
    h, cache = fwd(model, t, jnp.asarray(w)[:, None], cache, jnp.asarray(w))
    for b in range(B):
      if w[b] < T:
        got[b].append(h[b, 0])
    w = w + 1
  for b in range(B):
    np.testing.assert_allclose(jnp.stack(got[b][:T]), full[b], atol=1e-4, rtol=0)
  for leaf in jax.tree.leaves(cache):              # rows past B: untouched
    np.testing.assert_array_equal(leaf[B:], 7.0)


def test_cpu_decode_reads_its_cache_rows_in_place():
  """Decoding the first B rows of an N-row cache: the compiled CPU program never holds those B
  rows' keys or values as an array of their own (XLA:CPU copied a slice [:B] of every layer's
  cache before its products; a decode of 16 of 32 rows cost what 32 rows cost)."""
  model = _model("llama")
  B, N, S = 2, 8, 64
  cfg = model.cfg
  fns, params = model.inference_fns(), model.inference_params()
  cache = model.init_cache(N, S)
  args = (params, jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 1), jnp.int32), cache,
          jnp.zeros(B, jnp.int32))
  hlo = jax.jit(fns, donate_argnums=3).lower(*args).compile().as_text()
  K, h = cfg.n_kv_heads, cfg.head_dim
  for shape in (f"[{B},{K},{h},{S}]", f"[{B},{K},{S},{h}]"):
    assert f"f32{shape}" not in hlo, f"the decode program copies cache rows {shape}"


def test_cached_forward_into_scattered_rows():
  """rows_B (the engine's prefill of scattered slots): each input row writes and reads only
  its own cache row; other rows stay untouched; a repeated padding row is harmless."""
  model = _model("llama")
  T, S, R = 6, 16, 5
  tokens = _tokens(2, T)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  full = _forward(model, tokens, pos, jnp.ones((2, T), jnp.int32))
  fns, params = model.inference_fns(), model.inference_params()
  cache = model.init_cache(R, S)
  sentinel = jax.tree.map(lambda x: x.at[1].set(7.0), cache)   # row 1 holds someone's session
  rows = jnp.asarray([3, 0, 0])                                 # the last row is padding
  tok3 = jnp.concatenate([tokens, tokens[1:]], 0)
  h, out = jax.jit(fns)(params, tok3, jnp.concatenate([pos, pos[1:]], 0), sentinel,
                        jnp.zeros(3, jnp.int32), rows)
  np.testing.assert_allclose(h[:2], full, atol=1e-4, rtol=0)
  for new, old in zip(jax.tree.leaves(out), jax.tree.leaves(sentinel)):
    for r in (1, 2, 4):
      np.testing.assert_array_equal(new[r], old[r])
  # Decoding the next position of row 3 from the written cache continues the same sequence.
  nxt = 1234
  longer = jnp.concatenate([tokens[:1], jnp.asarray([[nxt]])], 1)
  ref = _forward(model, longer, jnp.arange(T + 1)[None], jnp.ones((1, T + 1), jnp.int32))
  h1, _ = jax.jit(fns)(params, jnp.asarray([[nxt]]), jnp.asarray([[T]]), out,
                       jnp.asarray([T]), jnp.asarray([3]))
  np.testing.assert_allclose(h1[0, 0], ref[0, T], atol=1e-4, rtol=0)


def test_packed_rows_equal_separate_rows():
  model = _model("qwen3")
  lengths = [5, 3, 6]
  T = 16
  positions, segments = make_packed_inputs([lengths], T)
  tokens = _tokens(1, T)
  packed = _forward(model, tokens, jnp.asarray(positions), jnp.asarray(segments))
  packed_lp = _logprobs(model, packed, tokens)
  # The same segments as separate rows (one batch, right-padded with segment id 0).
  n_max = max(lengths)
  starts = np.cumsum([0] + lengths[:-1])
  rows = np.zeros((len(lengths), n_max), np.int32)
  for r, (s0, n) in enumerate(zip(starts, lengths)):
    rows[r, :n] = np.asarray(tokens[0, s0:s0 + n])
  seg = (np.arange(n_max)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  pos = np.broadcast_to(np.arange(n_max), rows.shape)
  alone = _forward(model, jnp.asarray(rows), jnp.asarray(pos), jnp.asarray(seg))
  alone_lp = _logprobs(model, alone, jnp.asarray(rows))
  for r, (s0, n) in enumerate(zip(starts, lengths)):
    np.testing.assert_allclose(packed[0, s0:s0 + n], alone[r, :n], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed_lp[0, s0:s0 + n], alone_lp[r, :n], atol=1e-5, rtol=0)


def test_causality_via_gradients():
  model = _model("llama31")
  B, T = 2, 10
  positions, segments = make_packed_inputs([[4, 6], [10]], T)
  tokens = _tokens(B, T)
  emb = jnp.take(model.embed[...], tokens, axis=0)

  def out_at(x_BxTxD, b, t):
    h = model.forward_embeddings(x_BxTxD, jnp.asarray(positions), jnp.asarray(segments))
    return h[b, t].sum()

  grad = jax.jit(jax.grad(out_at))   # b, t traced: one compile
  for b, t in [(0, 2), (0, 5), (1, 7)]:
    g = grad(emb, b, t)
    influence = np.abs(np.asarray(g)).sum(-1)   # [B, T]
    seg = segments[b]
    for bb in range(B):
      for tt in range(T):
        allowed = bb == b and tt <= t and seg[tt] == seg[t]
        assert (influence[bb, tt] > 0) == allowed, (b, t, bb, tt)


def test_token_logprobs_chunked_equals_full_with_gradients():
  model = _model("qwen2")
  B, T = 2, 9
  tokens = _tokens(B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)

  def loss(m, chunk, temp):
    h = m(tokens, pos, seg)
    return -token_logprobs(m, h, tokens, temperature=temp, chunk=chunk).mean()

  def reference(m, temp):
    h = m(tokens, pos, seg)
    lp = jax.nn.log_softmax(m.logits(h) / temp, axis=-1)
    return -jnp.take_along_axis(lp, tokens[..., None], -1).mean()

  ref_fn = nnx.jit(nnx.value_and_grad(reference))
  loss_fn = nnx.jit(nnx.value_and_grad(loss), static_argnums=1)
  for temp in (1.0, 0.7):
    ref_l, ref_g = ref_fn(model, temp)
    for chunk in (7,):   # a ragged last chunk; chunk >= B*T is the reference formula itself
      l, g = loss_fn(model, chunk, temp)
      np.testing.assert_allclose(l, ref_l, rtol=1e-5)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
  h = _forward(model, tokens, pos, seg)
  assert _logprobs(model, h, tokens).dtype == jnp.float32


@pytest.mark.parametrize("variant", ["llama", "qwen2"])   # tied and untied LM head
def test_token_logprob_sum_equals_token_logprobs_with_gradients(variant):
  """The fused form (head gradient computed in the forward pass) against sum(coef * logp)."""
  model = _model(variant)
  B, T = 2, 9
  tokens = _tokens(B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  coef = jax.random.normal(jax.random.key(3), (B, T)) * (jnp.arange(T) % 4 != 0)  # some zeros

  def fused(m, temp):
    h = m(tokens, pos, seg)
    return token_logprob_sum(m, h, tokens, coef, temperature=temp, chunk=7)   # ragged chunks

  def reference(m, temp):
    h = m(tokens, pos, seg)
    lp = token_logprobs(m, h, tokens, temperature=temp)
    return jnp.sum(coef * lp), lp

  fused_fn = nnx.jit(nnx.value_and_grad(fused, has_aux=True))
  ref_fn = nnx.jit(nnx.value_and_grad(reference, has_aux=True))
  for temp in (1.0, 0.7):
    (total, logp), g = fused_fn(model, temp)
    (ref_total, ref_logp), ref_g = ref_fn(model, temp)
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
      np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()) + 1e-7, rtol=1e-4)
    assert float(np.abs(np.asarray(g["embed"][...])).max()) > 0
  # Only the sum is differentiable: logp comes back under stop_gradient, coef is a constant.
  g_logp = nnx.grad(lambda m: fused(m, 1.0)[1].sum())(model)
  assert all(float(np.abs(np.asarray(x)).max()) == 0 for x in jax.tree.leaves(g_logp))
  g_coef = jax.grad(lambda c: token_logprob_sum(model, model(tokens, pos, seg), tokens, c)[0])(coef)
  assert float(np.abs(np.asarray(g_coef)).max()) == 0
  # Without differentiation (evaluation) it is the plain chunked computation.
  total, logp = nnx.jit(fused, static_argnums=1)(model, 1.0)
  np.testing.assert_allclose(logp, ref_fn(model, 1.0)[0][1], rtol=1e-5, atol=1e-5)


def test_blocked_causal_attention_equals_one_block():
  """Query blocks that skip the masked upper triangle give the same outputs and gradients."""
  # XLA's blocked attention (MKL's kernel has no attention_block).
  one = _model("qwen3", attention_block=64, kernels="xla")
  T = 11
  positions, segments = make_packed_inputs([[4, 7], [11]], T)   # packed rows, ragged blocks
  pos, seg, tokens = jnp.asarray(positions), jnp.asarray(segments), _tokens(2, T)
  # A linear readout: mean(h^2) of RMS-normed h is nearly scale-invariant, so its gradient is
  # a cancellation residue that float32 cannot compare.
  r = jax.random.normal(jax.random.key(5), (2, T, one.cfg.d_model))
  loss = lambda m: (m(tokens, pos, seg) * r).sum()
  ref_h, ref_g = _forward(one, tokens, pos, seg), nnx.jit(nnx.grad(loss))(one)
  for block in (3, 4):
    m = Transformer(one.cfg.replace(attention_block=block), rngs=nnx.Rngs(0))
    nnx.update(m, nnx.state(one))
    np.testing.assert_allclose(_forward(m, tokens, pos, seg), ref_h, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(nnx.jit(nnx.grad(loss))(m)), jax.tree.leaves(ref_g)):
      np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()), rtol=1e-4)
  with pytest.raises(ValueError, match="attention_block"):
    one.cfg.replace(attention_block=0)


def test_scan_and_unrolled_layers_agree():
  a = _model("qwen2")
  b = Transformer(a.cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))
  nnx.update(b, nnx.state(a))
  tokens = _tokens(2, 8)
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  seg = jnp.ones((2, 8), jnp.int32)
  np.testing.assert_allclose(_forward(a, tokens, pos, seg), _forward(b, tokens, pos, seg),
                             atol=1e-5, rtol=0)
  grad = nnx.jit(nnx.grad(lambda m: (m(tokens, pos, seg) ** 2).mean()))
  ga = grad(a)
  for remat in ("full",):
    c = Transformer(a.cfg.replace(remat=remat), rngs=nnx.Rngs(0))
    nnx.update(c, nnx.state(a))
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(grad(c))):
      np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)


def test_bfloat16_params_and_activations_with_float32_logits():
  model = _model("llama", param_dtype="bfloat16", dtype="bfloat16")
  assert model.embed[...].dtype == jnp.bfloat16
  assert model.layers.wq[...].dtype == jnp.bfloat16
  tokens = _tokens(2, 8)
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  h = _forward(model, tokens, pos, jnp.ones((2, 8), jnp.int32))
  assert h.dtype == jnp.bfloat16
  assert model.logits(h).dtype == jnp.float32
  lp = _logprobs(model, h, tokens)
  assert lp.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(lp)))


def test_mlp_custom_gradient_matches_autodiff():
  from rao_jax.model.transformer import _mlp
  rng = np.random.default_rng(0)
  D, F = 6, 7
  y = jnp.asarray(rng.normal(size=(3, 5, D)) * 2, jnp.float32)
  wg, wu = (jnp.asarray(rng.normal(size=(D, F)), jnp.float32) for _ in range(2))
  wd = jnp.asarray(rng.normal(size=(F, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 5, D)), jnp.float32)

  def ref_mlp(y, wg, wu, wd):
    return (jax.nn.silu(y @ wg) * (y @ wu)) @ wd
  args = (y, wg, wu, wd)
  np.testing.assert_allclose(_mlp(*args), ref_mlp(*args), rtol=1e-5, atol=1e-5)
  ours = jax.grad(lambda *a: jnp.sum(_mlp(*a) * w), argnums=(0, 1, 2, 3))(*args)
  ref = jax.grad(lambda *a: jnp.sum(ref_mlp(*a) * w), argnums=(0, 1, 2, 3))(*args)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_lm_head_on_loss_positions_only_matches_all_positions(fused):
  """With a loss mask, only masked positions go through the LM head (gathered first, the other
  chunks skipped): the same sum, log-probs and gradients as over every position, and 0 where
  the mask is off."""
  model = _model("llama")
  B, T = 2, 16
  tokens = _tokens(B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  mask = jnp.zeros((B, T), bool).at[0, 3:7].set(True).at[1, 10:12].set(True)   # 6 of 32
  coef = jnp.where(mask, jax.random.normal(jax.random.key(5), (B, T)), 0.0)

  def ours(m):
    h = m(tokens, pos, seg)
    if fused:
      return token_logprob_sum(m, h, tokens, coef, chunk=4, mask_BxT=mask)
    lp = token_logprobs(m, h, tokens, chunk=4, mask_BxT=mask)
    return jnp.sum(coef * lp), lp

  def reference(m):
    h = m(tokens, pos, seg)
    lp = token_logprobs(m, h, tokens)
    return jnp.sum(coef * lp), lp

  (total, logp), g = nnx.jit(nnx.value_and_grad(ours, has_aux=True))(model)
  (ref_total, ref_logp), ref_g = nnx.jit(nnx.value_and_grad(reference, has_aux=True))(model)
  np.testing.assert_allclose(total, ref_total, rtol=1e-5)
  np.testing.assert_allclose(np.where(mask, logp, 0.0), np.where(mask, ref_logp, 0.0),
                             rtol=1e-5, atol=1e-5)
  assert float(np.abs(np.asarray(logp)[~np.asarray(mask)]).max()) == 0.0
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()) + 1e-7, rtol=1e-4)
