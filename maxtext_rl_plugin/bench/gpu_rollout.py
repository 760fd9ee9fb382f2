"""`bench gpu`'s rollout part: the embedded engine's greedy decode against the HBM roofline, and the HF peer.

What it measures and how: the docstring of `bench/gpu.py`."""

# jax, and everything that imports it, is imported inside the functions: a part decides its XLA/JAX environment
# before the backend starts, and the orchestrator never starts one. torch is optional (the HF peer).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import time

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.bench import gpu_common


def decode_bytes_per_step(cfg, weight_bytes: int, batch: int, context: float) -> float:
  """Bytes one decode step must read: the weights it multiplies by (`weight_bytes`) plus K and V of every layer over
  `context` positions of each row, in the activation dtype."""
  import jax.numpy as jnp

  kv = 2 * int(cfg.num_decoder_layers) * int(cfg.num_kv_heads) * int(cfg.head_dim) * jnp.dtype(cfg.dtype).itemsize
  return weight_bytes + batch * context * kv


def read_weight_bytes(model, cfg) -> int:
  """Bytes of the parameters a decode step reads: all of them, less the input embedding table when the LM head is a
  separate kernel (the lookup reads a row per token; a tied head reads the whole table)."""
  import jax
  from flax import nnx

  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  if not cfg.logits_via_embedding:
    total -= params["base"]["token_embedder"]["embedding"].nbytes
  return int(total)


def _random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  import numpy as np

  rng = np.random.default_rng(seed)
  return rng.integers(10, min(vocab, 30000), size=(batch, length)).tolist()


def _timed_generate(engine, prompts, new_tokens: int, repeats: int):
  """(median seconds, tokens) of greedy generates of exactly `new_tokens`; the first call (compile) untimed."""
  import numpy as np

  res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=new_tokens, ignore_stop=True)
  t = common.timed(
      lambda: engine.generate_tokens(prompts, greedy=True, max_new_tokens=new_tokens, ignore_stop=True), repeats
  )
  return t.seconds, np.asarray(res.tokens)


def hf_state_dict(model, cfg) -> dict:
  """The MaxText model's weights under Hugging Face names and layouts (`Qwen3ForCausalLM`, `LlamaForCausalLM`), as
  float32 NumPy: the vLLM sync's own mapping (rollout/vllm_mapping.py: MaxText's export tables; Llama's query
  un-scaled and its RoPE halves de-interleaved; an untied head as `lm_head.weight`), so the peer runs exactly what the
  engine would. tests/tpu_contract/test_hf_peer.py runs HF's model on it against MaxText's logits."""
  import numpy as np
  from flax import nnx

  from maxtext_rl_plugin.rollout import vllm_mapping

  hf = vllm_mapping.map_maxtext_to_vllm(
      nnx.state(model, nnx.Param), cfg.model_name, param_scan_axis=int(cfg.param_scan_axis)
  )
  return {k: np.array(v, np.float32) for k, v in hf.items()}


# MaxText 0.2.5's Llama 3.1 RoPE scaling (LLaMARotaryEmbedding._apply_scaling_factor hard-codes these), as HF spells it.
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA31_ROPE_CONTEXT = 8192


def hf_config(cfg):
  """The transformers config of the MaxText model's shape: Qwen3 or Llama 3.1, tied or untied head, the RoPE MaxText
  applies (llama3.1-* models get LLaMARotaryEmbedding: llama3 scaling unless `rope_use_scale=false`)."""
  import transformers

  rope = {"rope_type": "default", "rope_theta": float(cfg.rope_max_timescale)}
  llama = cfg.decoder_block.value != "qwen3"
  if cfg.model_name.startswith("llama3.1") and cfg.rope_use_scale:
    rope = {**rope, **_LLAMA31_ROPE, "original_max_position_embeddings": _LLAMA31_ROPE_CONTEXT}
  cls = transformers.LlamaConfig if llama else transformers.Qwen3Config
  return cls(  # pylint: disable=unexpected-keyword-arg  # transformers 5 configs take **kwargs
      vocab_size=int(cfg.vocab_size),
      hidden_size=int(cfg.emb_dim),
      intermediate_size=int(cfg.mlp_dim),
      num_hidden_layers=int(cfg.num_decoder_layers),
      num_attention_heads=int(cfg.num_query_heads),
      num_key_value_heads=int(cfg.num_kv_heads),
      head_dim=int(cfg.head_dim),
      rms_norm_eps=float(cfg.normalization_layer_epsilon),
      max_position_embeddings=int(cfg.max_target_length) + 8,
      tie_word_embeddings=bool(cfg.logits_via_embedding),
      rope_parameters=rope,
  )


def hf_model(cfg, state_dict: dict | None = None, dtype: str = "bfloat16"):
  """(model, device): a Hugging Face causal LM of the MaxText model's shape on torch's default device, holding
  `state_dict` (`hf_state_dict`'s; every tensor of the model must be in it, nothing else) or its own random init."""
  import torch
  import transformers

  dev = "cuda" if torch.cuda.is_available() else "cpu"
  dt = getattr(torch, dtype)
  with torch.device(dev):
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dt, attn_implementation="sdpa")
  if state_dict is not None:
    sd = {k: torch.from_numpy(v).to(dev, dt) for k, v in state_dict.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if cfg.logits_via_embedding else set()
    if unexpected or set(missing) - tied:
      raise RuntimeError(f"HF weight map: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
  return hf.eval(), dev


def _hf_generate(hf, dev, prompts, new_tokens: int, repeats: int, compiled: bool) -> dict:
  """Median seconds (first call untimed: cache allocation, compilation) and greedy tokens of HF `generate`."""
  import numpy as np
  import torch

  ids = torch.tensor(prompts, device=dev)
  kw = {
      "attention_mask": torch.ones_like(ids),
      "max_new_tokens": new_tokens,
      "min_new_tokens": new_tokens,
      "do_sample": False,
      "cache_implementation": "static",
      "disable_compile": not compiled,
      "pad_token_id": 0,
  }

  def run():
    with torch.inference_mode():
      out = hf.generate(ids, **kw)
    if dev == "cuda":
      torch.cuda.synchronize()
    return out

  t0 = time.perf_counter()
  out = run()
  first = time.perf_counter() - t0
  t = common.timed(run, repeats)
  return {"seconds": t.seconds, "first_call_s": first, "tokens": out[:, ids.shape[1] :].cpu().numpy().astype(np.int64)}


def greedy_agreement(a, b) -> dict:
  """How far two greedy token matrices agree: rows identical, mean first-mismatch step (bf16 kernels of two
  frameworks round differently, so a near-tie flips and the continuations part from there)."""
  import numpy as np

  diff = a != b
  first = np.where(diff.any(1), diff.argmax(1), a.shape[1])
  return {"rows_identical": float((~diff.any(1)).mean()), "mean_first_mismatch_step": float(first.mean())}


def _rollout_model(args, name: str, ref: dict, peers: bool, done: dict) -> dict:
  """Every batch size of one shape; the peer at `--peer-batches`."""
  import jax
  from flax import nnx

  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import models
  from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
  from maxtext_rl_plugin.bench import peak as bench_peak
  from maxtext_rl_plugin.rollout import embedded
  from maxtext_rl_plugin.run import engine as run_engine

  P, T = args.prompt_len, args.new_tokens
  argv = gpu_common.config_argv(
      args, name, [*gpu_common.BF16, f"max_prefill_predict_length={P}", f"max_target_length={P + T}"]
  )
  rs = models.setup_devices(config_lib.parse(argv))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.sampler_config))
  cfg = rs.sampler_config
  model, mesh = models.build_model(cfg, rs.sampler_devices, pad_id=tok.pad_token_id)

  # At init scale a random model repeats one token; x3 decoder weights make greedy continuations depend on the
  # context, so the token comparison means something (bench rollout does the same). Speed does not change.
  def scale(path, x):
    return x * 3 if "decoder" in [getattr(k, "key", None) for k in path] and x.ndim >= 2 else x

  nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(cfg, mesh)
  )
  wbytes = read_weight_bytes(model, cfg)
  out = {"model": name, "params": bench_peak.param_counts(cfg), "read_weight_bytes": wbytes, "by_batch": []}
  done["models"].append(out)
  hf, dev, peer_note = None, None, None
  if peers:
    try:
      # The 8B peer runs its own random weights: a float32 host copy of them would be 32 GB (speed is the same).
      hf, dev = hf_model(cfg, hf_state_dict(model, cfg) if name != "llama3.1-8b" else None)
    except Exception as e:  # pylint: disable=broad-exception-caught  # recorded in the JSON; the engine still runs
      peer_note = f"HF peer not built: {type(e).__name__}: {e}"
  for B in args.batch_sizes:
    prompts = _random_prompts(B, P, int(cfg.vocab_size))
    c0 = engine.compile_seconds
    prefill_s, _ = _timed_generate(engine, prompts, 1, args.repeats)
    full_s, toks = _timed_generate(engine, prompts, T, args.repeats)
    step_s = (full_s - prefill_s) / max(T - 1, 1)
    step_bytes = decode_bytes_per_step(cfg, wbytes, B, P + T / 2)
    prefill_flops = bench_peak.train_flops(cfg, B * P, P, passes=1)
    row = {
        "batch": B,
        "tokens_per_s": round(B * T / full_s, 1),
        "decode_tokens_per_s": round(B / step_s, 1) if step_s > 0 else None,
        "generate_s": round(full_s, 4),
        "prefill_s": round(prefill_s, 4),
        "decode_step_ms": round(1e3 * step_s, 3) if step_s > 0 else None,  # None: within noise of the prefill
        "decode_bytes_per_step": int(step_bytes),
        "decode_fraction_of_roofline": gpu_common.sig(step_bytes / ref["copy_bytes_per_s"] / step_s)
        if step_s > 0
        else None,
        "prefill_fraction_of_peak": gpu_common.sig(prefill_flops / prefill_s / ref["peak_flops"]),
        "compile_s": round(engine.compile_seconds - c0, 2),
    }
    if hf is not None and B in args.peer_batches:
      for label, compiled in (("hf_static", False), ("hf_static_compiled", True))[: 2 if args.hf_compile else 1]:
        try:
          r = _hf_generate(hf, dev, prompts, T, args.repeats, compiled)
          row[f"{label}_tokens_per_s"] = round(B * T / r["seconds"], 1)
          row[f"{label}_first_call_s"] = round(r["first_call_s"], 2)
          row[f"speedup_vs_{label}"] = round(r["seconds"] / full_s, 2)
          if name != "llama3.1-8b":
            row[f"{label}_greedy"] = greedy_agreement(toks, r["tokens"])
        except Exception as e:  # pylint: disable=broad-exception-caught  # recorded; the other figures stand
          row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:500]
    out["by_batch"].append(row)
    gpu_common.save_partial({"device": gpu_common.device_info(), **done, "partial": True})
    print(f"rollout {name} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
  if peer_note:
    out["peer_note"] = peer_note
  del engine, model, hf
  return out


def rollout_part(args) -> dict:
  """The references, then every `--models` shape; the HF peer where torch sees a GPU (or `--peers`)."""
  ref = gpu_common.references(args)
  peers, reason = args.peers, None
  try:
    import torch

    cuda = torch.cuda.is_available()
  except ImportError:
    torch, cuda, reason = None, False, "torch is not installed"
  if peers is None:
    peers = cuda
    reason = reason or (None if cuda else "torch sees no CUDA device (--peers forces the HF peer on CPU)")
  elif peers and torch is None:
    peers = False
  out = {"references": ref, "models": [], "peer_skipped": None if peers else reason}
  for name in args.models:
    _rollout_model(args, name, ref, peers, out)
  return out
