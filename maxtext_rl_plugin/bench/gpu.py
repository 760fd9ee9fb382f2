"""Absolute figures on whatever JAX backend is present (issue 31): `python -m maxtext_rl_plugin.bench gpu --out DIR`.

Four parts, each in its own process (a part that fails or runs out of time leaves the others' figures, and each
part's peak device memory is its own), their results merged into DIR/gpu_bench.json and DIR/gpu_bench.md after
every part:

* `rollout`: the embedded engine's greedy decode at each batch size for a Qwen3-0.6B- and a Llama-3.1-8B-shaped
  model (random bf16 weights), `--prompt-len` random prompt tokens + `--new-tokens` new ones. Prefill = a 1-token
  generate; decode step = (full generate - prefill) / (new tokens - 1). Decode against the HBM roofline: the bytes a
  step must read (every weight the step multiplies by, the LM head included, + the KV cache over the real context)
  over the measured device-to-device copy bandwidth (bytes read + written); prefill against the measured bf16 matmul
  peak. Peer, where torch sees a GPU (or `--peers` on CPU): Hugging Face `generate` with a static cache (eager, and
  torch.compile'd with `--hf-compile`) on the same weights for the Qwen3 shape (greedy tokens compared) and on its
  own random weights of the same shape for the Llama shape (MaxText's LLaMA RoPE is interleaved, HF's is not: the
  copy would need MaxText's q/k permutation; speed does not depend on the weights).
* `step`: one GRPO step of the 0.6B-shaped model, 8 prompts x 8 generations: `bench step` (the plugin's loop and
  Tunix's on one build, colocated on one device: no sync phase), with the update's MFU against the bf16 peak.
* `sync`: the weight sync of the 0.6B- and 8B-shaped weights: `bench reshard` where there are >= 2 devices; on one
  device, `resharding.reshard` onto a second mesh of it against a jitted copy of the same bytes.
* `demo`: `configs/cpu_demo.yml`'s run (what scripts/demo.sh runs), wall time and its before/after table.

`--dry` runs every part with tiny shapes on CPU in about a minute (tests/test_bench_gpu.py), so this cannot rot.
"""

# jax, and everything that imports it, is imported inside the functions: a part decides its XLA/JAX environment
# before the backend starts, and the orchestrator never starts one. torch is optional (the HF peer).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from maxtext_rl_plugin.bench import common

PARTS = ("rollout", "step", "sync", "demo")
BASE_CONFIG = "configs/cpu_tiny.yml"
# MaxText's own model configs are selected by model_name; cpu_tiny.yml's override_model_config lets these restore
# the full shapes over its tiny ones.
SHAPES = {
    "qwen3-0.6b": [
        "model_name=qwen3-0.6b",
        "base_emb_dim=1024",
        "base_num_query_heads=16",
        "base_num_kv_heads=8",
        "base_mlp_dim=3072",
        "base_num_decoder_layers=28",
        "head_dim=128",
        "vocab_size=151936",
    ],
    "llama3.1-8b": [
        "model_name=llama3.1-8b",
        "base_emb_dim=4096",
        "base_num_query_heads=32",
        "base_num_kv_heads=8",
        "base_mlp_dim=14336",
        "base_num_decoder_layers=32",
        "head_dim=128",
        "vocab_size=128256",
    ],
    # --dry: cpu_tiny.yml's 2-layer Qwen3 shape with the CPU demo's 528-token vocabulary (a 152k-row head would be
    # most of a dry run's time).
    "tiny": [
        "tokenizer_path=tokenizers/arith-bpe-512",
        "vocab_size=528",
        "use_chat_template=false",
        "data_template_path=cpu_demo_template.json",
    ],
}
BF16 = ["weight_dtype=bfloat16", "dtype=bfloat16"]
DRY = {
    "models": "tiny",
    "batch_sizes": "1,2",
    "peer_batches": "2",
    "prompt_len": 8,
    "new_tokens": 4,
    "repeats": 1,
    "step_set": ["batch_size=2", "rl.num_generations=2", "max_target_length=136"],
    "demo_set": [
        "sft_warmup_steps=0",
        "num_batches=1",
        "batch_size=2",
        "rl.num_generations=2",
        "num_test_batches=1",
        "eval_batch_size=8",
        "synthetic_num_eval=8",
        "enable_checkpointing=false",
        "write_plot=false",
    ],
    "peak_n": 128,
    "copy_mib": 4,
}


def _parse(argv):
  """The command line (see --help)."""
  p = argparse.ArgumentParser(prog="python -m maxtext_rl_plugin.bench gpu", description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="directory for gpu_bench.json and gpu_bench.md (created)")
  p.add_argument("--dry", action="store_true", help="every code path at tiny shapes (CPU, about a minute)")
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
  p.add_argument("--models", default="qwen3-0.6b,llama3.1-8b", help=f"rollout/sync shapes, of {','.join(SHAPES)}")
  p.add_argument("--batch-sizes", default="1,8,32,128", help="rollout batch sizes")
  p.add_argument("--peer-batches", default="1,32", help="batch sizes at which the HF peer also runs")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
  p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None, help="HF peer (default: if CUDA)")
  p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True, help="also torch.compile'd HF")
  p.add_argument("--step-steps", type=int, default=2, help="bench step: measured steps per side (after 1 warm-up)")
  p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="extra MaxText overrides for every part")
  p.add_argument("--budget", type=int, default=3600, help="seconds for all parts; a part still running is stopped")
  p.add_argument("--peak-n", type=int, default=8192, help="bf16 matmul size of the peak measurement")
  p.add_argument("--copy-mib", type=int, default=2048, help="MiB of the device-to-device copy measurement")
  p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
  args = p.parse_args(argv)
  args.step_set, args.demo_set = [], []
  if args.dry:
    for k, v in DRY.items():
      setattr(args, k, v)
  args.parts = [x for x in args.parts.split(",") if x]
  args.models = [x for x in args.models.split(",") if x]
  args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
  args.peer_batches = [int(x) for x in args.peer_batches.split(",") if x]
  bad = [x for x in args.parts if x not in PARTS] + [x for x in args.models if x not in SHAPES]
  if bad:
    p.error(f"unknown part or model: {', '.join(bad)}")
  return args


# ------------------------------------------------------------------ device references


def device_info() -> dict:
  """The backend, device kind and count, JAX's version."""
  import jax

  d = jax.devices()[0]
  return {
      "backend": jax.default_backend(),
      "device": d.device_kind,
      "devices": jax.device_count(),
      "jax": jax.__version__,
  }


def hardware_overrides() -> list[str]:
  """MaxText's `hardware` key for the backend present (cpu_tiny.yml says cpu)."""
  import jax

  return ["hardware=gpu"] if jax.default_backend() == "gpu" else []


def copy_bandwidth(mib: int, repeats: int = 5) -> dict:
  """Device-to-device copy bandwidth: a jitted elementwise op over `mib` MiB of bf16 (read + write bytes / best
  time), the HBM figure the decode roofline divides by."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((mib * 2**19,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return {"copy_bytes_per_s": 2 * x.nbytes / best, "copy_mib": mib}


def peak_memory() -> dict:
  """Peak device memory of this process (None where the backend keeps no statistics, as on CPU) and peak RSS."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return {"peak_device_bytes": peak, "peak_rss_mib": round(common.status_kb("VmHWM") / 1024, 1)}


def references(args) -> dict:
  """bf16 matmul peak and copy bandwidth, measured in this process."""
  from maxtext_rl_plugin.bench import peak as bench_peak

  ref = bench_peak.measure_peak_flops(args.peak_n, dtype="bfloat16")
  return {"peak_flops": ref["peak_flops"], "peak_dtype": "bfloat16", **copy_bandwidth(args.copy_mib)}


def _run_main(module, argv: list[str]) -> dict:
  """A bench module's `main(argv)` in this process: its last stdout line (the JSON record); its output is echoed."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = module.main(argv)
  text = buf.getvalue()
  print(text, end="", flush=True)
  if rc:
    raise RuntimeError(f"{module.__name__} exited {rc}")
  return json.loads(text.strip().splitlines()[-1])


def save_partial(rec: dict) -> None:
  """Write a part's record so far (a part stopped by the budget still reports what it measured)."""
  path = os.environ.get("BENCH_GPU_PART_JSON")
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(rec, f)


def _config_argv(args, model: str, extra: list[str]) -> list[str]:
  return [BASE_CONFIG, *SHAPES[model], *hardware_overrides(), *extra, *args.set]


# ------------------------------------------------------------------ rollout


def _sig(x: float, digits: int = 3) -> float:
  """`x` to `digits` significant figures: a fraction of a roofline spans decades (3e-5 on a loaded CPU, 0.6 on an
  H100), and rounding to fixed decimals would turn the small ones into a false 0."""
  return float(f"{x:.{digits}g}")


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
  """The MaxText Qwen3 model's weights under Hugging Face `Qwen3ForCausalLM` names and layouts, as float32 NumPy
  (MaxText scans layers on axis 1 of every kernel; HF's Linear weights are [out, in])."""
  import numpy as np
  from flax import nnx

  src = nnx.to_pure_dict(nnx.state(model, nnx.Param))["base"]
  dec, lay = src["decoder"], src["decoder"]["layers"]
  sa, mlp = lay["self_attention"], lay["mlp"]

  def a(x):
    return np.asarray(x, np.float32)

  sd = {
      "model.embed_tokens.weight": a(src["token_embedder"]["embedding"]),
      "model.norm.weight": a(dec["decoder_norm"]["scale"]),
  }
  for i in range(int(cfg.num_decoder_layers)):
    p = f"model.layers.{i}."
    for hf, mt in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
      k = a(sa[mt]["kernel"][:, i])  # [emb, heads, head_dim]
      sd[p + f"self_attn.{hf}.weight"] = k.reshape(k.shape[0], -1).T
    o = a(sa["out"]["kernel"][:, i])  # [heads, head_dim, emb]
    sd[p + "self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
    sd[p + "self_attn.q_norm.weight"] = a(sa["query_norm"]["scale"][:, i])
    sd[p + "self_attn.k_norm.weight"] = a(sa["key_norm"]["scale"][:, i])
    sd[p + "input_layernorm.weight"] = a(lay["pre_self_attention_layer_norm"]["scale"][:, i])
    sd[p + "post_attention_layernorm.weight"] = a(lay["post_self_attention_layer_norm"]["scale"][:, i])
    for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
      sd[p + f"mlp.{hf}.weight"] = a(mlp[mt]["kernel"][:, i]).T
  return sd


def _hf_model(model, cfg, copy_weights: bool):
  """A Hugging Face causal LM of the MaxText model's shape on torch's default device, bf16."""
  import torch
  import transformers

  common_kw = {
      "vocab_size": int(cfg.vocab_size),
      "hidden_size": int(cfg.emb_dim),
      "intermediate_size": int(cfg.mlp_dim),
      "num_hidden_layers": int(cfg.num_decoder_layers),
      "num_attention_heads": int(cfg.num_query_heads),
      "num_key_value_heads": int(cfg.num_kv_heads),
      "head_dim": int(cfg.head_dim),
      "rms_norm_eps": float(cfg.normalization_layer_epsilon),
      "max_position_embeddings": int(cfg.max_target_length) + 8,
      "tie_word_embeddings": bool(cfg.logits_via_embedding),
      "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_max_timescale)},
  }
  cls = transformers.Qwen3Config if cfg.decoder_block.value == "qwen3" else transformers.LlamaConfig
  hf_cfg = cls(**common_kw)  # pylint: disable=unexpected-keyword-arg  # transformers 5 configs take **kwargs
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  with torch.device(dev):
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
  if copy_weights:
    sd = {k: torch.from_numpy(v).to(dev, torch.bfloat16) for k, v in hf_state_dict(model, cfg).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
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

  from maxtext_rl_plugin import models
  from maxtext_rl_plugin.bench import peak as bench_peak
  from maxtext_rl_plugin.rollout import embedded

  P, T = args.prompt_len, args.new_tokens
  argv = _config_argv(args, name, [*BF16, f"max_prefill_predict_length={P}", f"max_target_length={P + T}"])
  rs = models.setup_devices(argv)
  tok = models.load_tokenizer(rs.sampler_config)
  cfg = rs.sampler_config
  model, mesh = models.build_model(cfg, rs.sampler_devices, pad_id=tok.pad_token_id)

  # At init scale a random model repeats one token; x3 decoder weights make greedy continuations depend on the
  # context, so the token comparison means something (bench rollout does the same). Speed does not change.
  def scale(path, x):
    return x * 3 if "decoder" in [getattr(k, "key", None) for k in path] and x.ndim >= 2 else x

  nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  engine = embedded.EmbeddedRollout(rollout_actor=model, tokenizer=tok, mesh=mesh, config=cfg)
  wbytes = read_weight_bytes(model, cfg)
  out = {"model": name, "params": bench_peak.param_counts(cfg), "read_weight_bytes": wbytes, "by_batch": []}
  done["models"].append(out)
  hf, dev, peer_note = None, None, None
  if peers:
    try:
      hf, dev = _hf_model(model, cfg, copy_weights=name != "llama3.1-8b" and cfg.decoder_block.value == "qwen3")
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
        "decode_fraction_of_roofline": _sig(step_bytes / ref["copy_bytes_per_s"] / step_s) if step_s > 0 else None,
        "prefill_fraction_of_peak": _sig(prefill_flops / prefill_s / ref["peak_flops"]),
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
    save_partial({"device": device_info(), **done, "partial": True})
    print(f"rollout {name} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
  if peer_note:
    out["peer_note"] = peer_note
  del engine, model, hf
  return out


def rollout_part(args) -> dict:
  """The references, then every `--models` shape; the HF peer where torch sees a GPU (or `--peers`)."""
  ref = references(args)
  peers, reason = args.peers, None
  try:
    import torch  # pylint: disable=unused-import

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


# ------------------------------------------------------------------ step, sync, demo


def step_part(args) -> dict:
  """`bench step` (colocated) on the 0.6B shape; the update's MFU against the bf16 peak; this process's peak memory."""
  from maxtext_rl_plugin.bench import step as bench_step

  ref = references(args)
  model = "tiny" if args.dry else "qwen3-0.6b"
  sets = args.step_set or [
      "batch_size=8",
      "rl.num_generations=8",
      "max_prefill_predict_length=128",
      "max_target_length=384",
  ]
  argv = [
      "--colocated",
      "--steps",
      str(args.step_steps if not args.dry else 1),
      "--warmup",
      "1" if not args.dry else "0",
      "--config",
      BASE_CONFIG,
      *SHAPES[model],
      *hardware_overrides(),
      "dtype=bfloat16",
      *sets,
      *args.set,
  ]
  r = _run_main(bench_step, argv)
  upd = r["flops"]["plugin"]["update"]
  mfu = {side: float(f'{upd / r[f"{side}_s"]["update"] / ref["peak_flops"]:.4g}') for side in ("plugin", "tunix")}
  return {"references": ref, "bench_step": r, "update_mfu": mfu, **peak_memory()}


def _one_device_sync(args, name: str) -> dict:
  """One device: `resharding.reshard` of the weights onto a second mesh of it, against a jitted copy of the same
  bytes (what a sync that must copy costs at best); `aliases_source` says whether reshard copied at all."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from maxtext_rl_plugin import models
  from maxtext_rl_plugin.resharding import move, trees

  rs = models.setup_devices(_config_argv(args, name, [*BF16]))
  model, mesh = models.build_model(rs.trainer_config, rs.trainer_devices)
  src = nnx.state(model, nnx.Param)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(src))
  smesh = Mesh(np.array(rs.sampler_devices).reshape(mesh.devices.shape), mesh.axis_names)
  dst = trees.logical_shardings(src, smesh, rs.trainer_config.logical_axis_rules)
  held = {"w": move.reshard(src, dst)}

  def sync():
    held["w"] = move.reshard(src, dst, release=held["w"])
    return held["w"]

  t_sync = common.timed(sync, args.repeats)
  keep = set().union(*(move.buffer_ids(x) for x in jax.tree.leaves(src)))
  aliases = any(move.buffer_ids(x) & keep for x in jax.tree.leaves(t_sync.result))
  copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
  jax.block_until_ready(copy(src))
  t_copy = common.timed(lambda: jax.block_until_ready(copy(src)), args.repeats)
  equal = all(
      np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(t_sync.result))
  )
  return {
      "model": name,
      "bytes": int(nbytes),
      "method": "one device: reshard onto a second mesh of it",
      "reshard_s": round(t_sync.seconds, 5),
      "reshard_bytes_per_s": round(nbytes / t_sync.seconds),
      "aliases_source": bool(aliases),
      "copy_s": round(t_copy.seconds, 5),
      "copy_bytes_per_s": round(nbytes / t_copy.seconds),
      "bitwise_equal": bool(equal),
  }


def sync_part(args) -> dict:
  """Each `--models` shape's weights: `bench reshard` across two device halves, or one device's copy (see above)."""
  import jax

  from maxtext_rl_plugin.bench import reshard as bench_reshard

  out = {"references": copy_bandwidth(args.copy_mib), "models": []}
  for name in args.models:
    if jax.device_count() >= 2:
      sets = [*SHAPES[name], *BF16, *hardware_overrides(), *args.set]
      r = _run_main(bench_reshard, ["--config", BASE_CONFIG, "--ckpt-repeats", "0", "--set", *sets])
      out["models"].append({"model": name, "method": "bench reshard (trainer half -> sampler half)", **r})
    else:
      out["models"].append(_one_device_sync(args, name))
    save_partial({"device": device_info(), **out, "partial": True})
  return out


def demo_part(args) -> dict:
  """configs/cpu_demo.yml's run as scripts/demo.sh starts it (without its venv step), wall time and summary table."""
  import jax

  with tempfile.TemporaryDirectory(prefix="bench_gpu_demo_") as tmp:
    cmd = [
        sys.executable,
        "-m",
        "maxtext_rl_plugin.train_rl",
        "configs/cpu_demo.yml",
        f"base_output_directory={tmp}",
        *(["hardware=gpu"] if jax.default_backend() == "gpu" else []),
        *args.demo_set,
        *args.set,
    ]
    t0 = time.perf_counter()
    left = float(os.environ.get("BENCH_GPU_DEADLINE", time.time() + args.budget)) - time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=max(left, 1))
    wall = time.perf_counter() - t0
  print(p.stdout[-4000:], p.stderr[-4000:], sep="\n", flush=True)
  m = re.search(r"^metric .*?held-out examples\)", p.stdout, re.M | re.S)
  table = m.group(0).rstrip() if m else None
  out = {"returncode": p.returncode, "wall_s": round(wall, 1), "summary_table": table, "command": " ".join(cmd[1:])}
  if p.returncode:
    out["error"] = f"the demo run exited {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1][:500]}"
  return out


# ------------------------------------------------------------------ orchestration and report


def _run_part(argv: list[str], part: str, deadline: float) -> dict:
  """One part in a fresh process (own device memory, own failure) until `deadline`; its JSON record (what it saved
  so far, if stopped), or the error."""
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  env = dict(os.environ, BENCH_GPU_PART_JSON=path, BENCH_GPU_DEADLINE=str(deadline))
  cmd = [sys.executable, "-m", "maxtext_rl_plugin.bench", "gpu", *argv, "--part", part]
  t0 = time.perf_counter()
  try:
    rc = subprocess.run(cmd, env=env, check=False, timeout=max(deadline - time.time(), 1)).returncode
  except subprocess.TimeoutExpired:
    rc = "timeout"
  wall = round(time.perf_counter() - t0, 1)
  try:
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    if rc == "timeout":
      rec["error"] = "stopped at the --budget deadline; the figures here are what it had measured"
  except (OSError, ValueError):
    rec = {"error": f"part exited {rc} without a result (its output is above)"}
  finally:
    os.unlink(path)
  return {"wall_s": wall, **rec}


def _fmt(v, pct=False):
  if v is None:
    return "-"
  if pct:
    return f"{100 * v:.1f}%"
  return f"{v:,.1f}" if isinstance(v, float) else str(v)


def markdown(res: dict) -> str:
  """The human table of everything measured (the JSON holds more)."""
  info = res.get("device") or {}
  lines = [f"# bench gpu: {info.get('device')} ({info.get('backend')}, jax {info.get('jax')}), {res.get('date')}", ""]
  r = res.get("rollout", {})
  if "models" in r:
    ref = r["references"]
    lines += [
        f"bf16 matmul peak {ref['peak_flops'] / 1e12:.1f} TFLOP/s; device copy {ref['copy_bytes_per_s'] / 1e12:.2f} "
        "TB/s (read + write)",
        "",
        "| model | batch | tok/s | decode step ms | decode / roofline | prefill / peak | HF static tok/s | HF compiled "
        "tok/s | x best HF | greedy rows equal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in r["models"]:
      for b in m["by_batch"]:
        hf = [b.get("hf_static_tokens_per_s"), b.get("hf_static_compiled_tokens_per_s")]
        best = max((x for x in hf if x), default=None)
        eq = (b.get("hf_static_greedy") or {}).get("rows_identical")
        lines.append(
            f"| {m['model']} | {b['batch']} | {_fmt(b['tokens_per_s'])} | {_fmt(b['decode_step_ms'])} | "
            f"{_fmt(b['decode_fraction_of_roofline'], True)} | {_fmt(b['prefill_fraction_of_peak'], True)} | "
            f"{_fmt(hf[0])} | {_fmt(hf[1])} | {_fmt(best and round(b['tokens_per_s'] / best, 2))} | {_fmt(eq, True)} |"
        )
    if r.get("peer_skipped"):
      lines.append(f"\nHF peer skipped: {r['peer_skipped']}")
    lines.append("")
  s = res.get("step", {})
  if "bench_step" in s:
    b = s["bench_step"]
    lines += [f"GRPO step, {b['model']}, {b['batch']}, {b['new_tokens']} new tokens (warm step, s)", ""]
    lines += ["| phase | plugin | Tunix |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v} | {b['tunix_s'][k]} |" for k, v in b["plugin_s"].items()]
    pd = s.get("peak_device_bytes")
    lines += [
        "",
        f"update MFU (bf16 peak): plugin {_fmt(s['update_mfu']['plugin'], True)}, Tunix "
        f"{_fmt(s['update_mfu']['tunix'], True)}; peak device memory "
        f"{'-' if pd is None else f'{pd / 2**30:.2f} GiB'}",
        "",
    ]
  y = res.get("sync", {})
  if "models" in y:
    lines += [
        "| weights | bytes | sync s | sync GB/s | copy GB/s | method |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for m in y["models"]:
      sec = m.get("reshard_s")
      bps = None if m.get("aliases_source") else m.get("reshard_bytes_per_s")  # zero-copy: no bandwidth to speak of
      lines.append(
          f"| {m['model']} | {m['bytes']:,} | {sec} | {_fmt(bps and bps / 1e9)} | "
          f"{_fmt(m.get('copy_bytes_per_s') and m['copy_bytes_per_s'] / 1e9)} | {m['method']}"
          f"{' (zero-copy: the sampler holds the source arrays)' if m.get('aliases_source') else ''} |"
      )
    lines.append("")
  d = res.get("demo", {})
  if "wall_s" in d and "returncode" in d:
    lines += [f"demo run: {d['wall_s']} s wall (exit {d['returncode']})", "", "```", d.get("summary_table") or "-", "```"]
  for part in PARTS:
    if "error" in res.get(part, {}):
      lines.append(f"\n{part}: {res[part]['error']}")
  return "\n".join(lines) + "\n"


def _write(out_dir: str, res: dict) -> None:
  with open(os.path.join(out_dir, "gpu_bench.json"), "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
  with open(os.path.join(out_dir, "gpu_bench.md"), "w", encoding="utf-8") as f:
    f.write(markdown(res))


def _part_main(args) -> int:
  """Inside a part's process: run it, write its record to $BENCH_GPU_PART_JSON."""
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  fn = {"rollout": rollout_part, "step": step_part, "sync": sync_part, "demo": demo_part}[args.part]
  try:
    rec = {"device": device_info(), **fn(args)}
  except Exception as e:  # pylint: disable=broad-exception-caught  # the record names it; the other parts run on
    import traceback

    traceback.print_exc()
    rec = {"error": f"{type(e).__name__}: {e}"[:2000]}
  with open(os.environ["BENCH_GPU_PART_JSON"], "w", encoding="utf-8") as f:
    json.dump(rec, f)
  return 0


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # One process at a time holds the device, and the HF peer shares it with JAX: allocate on demand.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.dry:
    os.environ["JAX_PLATFORMS"] = "cpu"
  if args.part:
    return _part_main(args)
  os.makedirs(args.out, exist_ok=True)
  res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv}
  deadline = time.time() + args.budget
  for part in args.parts:
    print(f"== bench gpu: {part}", flush=True)
    res[part] = _run_part(argv, part, deadline)
    res["device"] = res.get("device") or res[part].get("device")
    _write(args.out, res)
  print(markdown(res))
  print(json.dumps({"benchmark": "gpu", **{k: v for k, v in res.items() if k != "argv"}}))
  return 0 if all("error" not in res[p] for p in args.parts) else 1


if __name__ == "__main__":
  sys.exit(main())
