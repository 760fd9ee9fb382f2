"""The vLLM rollout (`rollout_engine=vllm`) compiled as vLLM-TPU runs it: tpu-inference's model step on the sampler.

Runs in the TPU image's stack (tpu-inference importable; `.venv-tpu` + libtpu 0.0.48 here). What is real:

* the model: tpu-inference's native class the plugin's route picks (`rollout/vllm_config.choose_route`), for the
  `vllm.LLM` arguments the run passes (`vllm_config.vllm_engine_kwargs`: TP from `rollout_tensor_parallelism`, dtype,
  `max_model_len`, block size, batch limits), built with `nnx.eval_shape` on the runner's 2-D ('data', 'model') mesh
  of sampler devices (`TPUModelRunner._create_2d_mesh`), its config.json written from the MaxText model's dimensions;
* the step: what `model_loader.get_flax_model`'s jitted `run_model` and `run_compute_logits` run, as one program
  (the KV caches donated, logits of each request's last token), at the runner's padded shapes
  (`runner/utils.build_token_paddings`, `get_padded_num_reqs_with_upper_limit`, block tables of `max_num_seqs`
  requests). Its attention is the Pallas `ragged_paged_attention` kernel (a `tpu_custom_call` per layer, with the
  target's block sizes); the sampler (top-k/top-p over the logits) is not in the program;
* the KV pool: vLLM's own sizing. tpu-inference's `TPUWorker.determine_available_memory` gives
  sum over the worker's devices of (HBM limit x `hbm_utilization_vllm` - bytes in use), in use being the weights and,
  colocated, the trainer's resident state; tpu-inference's `KVCacheManager.get_kv_cache_spec` gives each layer's
  `FullAttentionSpec` (kv heads padded to TP, head_dim padded, page bytes from `runner/kv_cache.
  get_attention_page_size_bytes`); vLLM's `get_kv_cache_configs` turns both into `num_blocks` (and refuses a pool that
  cannot hold one request of `max_model_len`); each layer's cache is `get_kv_cache_shape_with_mesh(num_blocks, ...)`.

* a quantized sampler (`rollout_quantization=int8|fp8`): the engine gets the Qwix rules the quantized sync writes for
  (`engine_quantization`) and tpu-inference's own PTQ pass runs on the abstract model (`abstract_model`), so the state
  and the programs' arguments hold the QArray kernels (int8 / float8_e4m3fn values, per-channel scales) and the pool is
  sized from those smaller weights (aot/low_precision.py compiles the 70B recipe so, docs/aot.md).

Two programs: `vllm_prefill_step` (a full chunked-prefill step of `max_num_batched_tokens`) and `vllm_decode_step`
(one token for every running request); the rollout's step time is their roofline times the calls a step makes.
With vLLM data parallelism (`rollout_data_parallelism`) each replica of `tp` chips serves its share of the requests
with its own weights and pool: the programs are compiled for one replica, whose per-chip memory and time are the run's.

MaxText's own decoder inside vLLM (`MaxTextForCausalLM`) is tried the same way; its weights are created inside a
`jax.jit` under `jax.set_mesh`, which `nnx.eval_shape` cannot trace, and that route then gets a `not compiled:` line.
"""

# tpu_inference and vllm exist only in the TPU image's stack: imported where used (see tpu_inference_compat).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from typing import Any

from flax import nnx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.aot import report
from maxtext_rl_plugin.aot import tpu_inference_compat as compat
from maxtext_rl_plugin.aot.programs import Program
from maxtext_rl_plugin.aot.topology import GIB
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import precision
from maxtext_rl_plugin.rollout import vllm_config as vllm_config_lib
from maxtext_rl_plugin.rollout import vllm_mapping
from maxtext_rl_plugin.rollout import vllm_quantized
from maxtext_rl_plugin.rollout import vllm_maxtext

NEEDS_STACK = "vllm rollout needs tpu-inference (the TPU image's stack, .venv-tpu)"
KNOB = "rollout_tensor_parallelism (weights per chip) or hbm_utilization_vllm (KV pool)"
# The native classes the plugin maps onto (vllm_mapping.SUPPORTED_FAMILIES): HF architecture, model_type, module.
_NATIVE = {
    "llama3.1-": ("LlamaForCausalLM", "llama", "llama3"),
    "qwen3-": ("Qwen3ForCausalLM", "qwen3", "qwen3"),
}


class SamplerDoesNotFitError(ConfigError):
  """The sampler chips cannot hold the weights plus the smallest KV pool vLLM accepts (the one-line verdict)."""


@dataclasses.dataclass
class KvPool:
  """The KV pool vLLM would allocate, per the arithmetic in the module docstring (bytes are per device)."""

  num_blocks: int
  block_size: int
  layers: int
  layer_shape: tuple
  dtype: Any
  weights_bytes: int
  in_use_bytes: int
  available_bytes: int  # the worker's, summed over its devices
  pool_bytes: int  # per device

  def as_json(self) -> dict:
    return {
        "num_blocks": self.num_blocks,
        "block_size": self.block_size,
        "layers": self.layers,
        "layer_shape": list(self.layer_shape),
        "weights_gib_per_device": self.weights_bytes / GIB,
        "in_use_gib_per_device": self.in_use_bytes / GIB,
        "kv_pool_gib_per_device": self.pool_bytes / GIB,
        "tokens_in_pool": self.num_blocks * self.block_size,
    }


def _native(model_name: str) -> tuple[str, str, str]:
  return next(v for k, v in _NATIVE.items() if model_name.startswith(k))


def hf_config(cfg, max_model_len: int) -> dict:
  """The config.json vLLM reads (the run passes the checkpoint's; this one has the MaxText model's dimensions)."""
  arch, model_type, _ = _native(cfg.model_name)
  return {
      **vllm_mapping.HfShape.from_config(cfg).as_dict(),
      "architectures": [arch],
      "model_type": model_type,
      "rope_theta": float(cfg.rope_max_timescale),
      "rms_norm_eps": float(cfg.normalization_layer_epsilon),
      "max_position_embeddings": max(int(max_model_len), 1),
      "torch_dtype": jnp.dtype(cfg.weight_dtype).name,
  }


def engine_config(cfg, kwargs: dict, model_dir: str, quantization: str = ""):
  """The VllmConfig `vllm.LLM(**kwargs)` builds, as far as the model and the cache read it; a quantized sampler's
  Qwix rules in `additional_config` as tpu-inference reads them (`engine_quantization`)."""
  from tpu_inference.layers.common.sharding import ShardingConfigManager
  from tpu_inference.layers.vllm.backends.flash_attn import PallasAttentionBackend
  from tpu_inference.models.common.model_loader import to_jax_dtype
  from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

  path = os.path.join(model_dir, "config.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(hf_config(cfg, kwargs["max_model_len"]), f)
  tokens, seqs = compat.batch_defaults()
  tokens, seqs = kwargs.get("max_num_batched_tokens", tokens), kwargs.get("max_num_seqs", seqs)
  vc = VllmConfig(
      model_config=ModelConfig(
          model=model_dir, skip_tokenizer_init=True, dtype=kwargs["dtype"], max_model_len=kwargs["max_model_len"]
      ),
      device_config=DeviceConfig(device="cpu"),
      parallel_config=ParallelConfig(tensor_parallel_size=kwargs["tensor_parallel_size"]),
      cache_config=CacheConfig(gpu_memory_utilization=kwargs["gpu_memory_utilization"]),
      scheduler_config=SchedulerConfig(
          max_num_batched_tokens=tokens,
          max_num_seqs=seqs,
          max_model_len=kwargs["max_model_len"],
          is_encoder_decoder=False,
      ),
      additional_config=engine_quantization(kwargs, quantization),
  )
  # TpuPlatform.check_and_update_config's block size when the run sets none (vllm_block_size: null).
  block = kwargs.get("block_size") or max(
      PallasAttentionBackend.get_page_size(vc), PallasAttentionBackend.get_min_page_size(vc)
  )
  vc.cache_config.block_size = int(block)
  vc.model_config.dtype = to_jax_dtype(vc.model_config.dtype)  # as get_flax_model does
  vc.sharding_config = ShardingConfigManager.from_vllm_config(vc)
  return vc


def replica_mesh(devices: list, tp: int) -> Mesh:
  """One vLLM data-parallel replica's ('data', 'model') mesh: `tp` sampler devices in the order the run passes them."""
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES_2D

  return Mesh(np.array(devices[:tp], dtype=object).reshape(1, tp), MESH_AXIS_NAMES_2D)


def weight_format(scfg) -> str:
  """The sampler's `rollout_quantization` ('' for the checkpoint's dtype), spelled as rollout/precision.py reads it."""
  return precision.requested(scfg.rollout_quantization)


def engine_quantization(kwargs: dict, name: str) -> dict:
  """The `additional_config` entry that shapes a quantized sampler's state: the `quantization` the run's engine
  arguments carry (`vllm_engine_kwargs`), else the Qwix rules the quantized sync is written for
  (rollout/vllm_quantized.engine_quantization: every matmul weight of the forward, weight-only, one scale per output
  channel). The embedding (a lookup) and the output head (`compute_logits`, outside the traced forward) stay in the
  checkpoint's dtype."""
  quantization = dict(kwargs.get("additional_config") or {}).get("quantization")
  if quantization is None and name:
    quantization = vllm_quantized.engine_quantization(name)
  return {"quantization": quantization} if quantization else {}


def abstract_model(cls, vc, mesh: Mesh):
  """tpu-inference's class built abstractly on `mesh`: (graphdef, state with the mesh's NamedShardings).

  With Qwix rules in `additional_config` (a quantized sampler), tpu-inference's own PTQ pass runs inside the same
  `nnx.eval_shape` (`qwix_utils.apply_qwix_quantization(..., apply_to_abstract_model=True)`): `qwix.quantize_model`
  traces one forward step (through the target's attention kernel: `compat.for_target`) and replaces every weight a
  matmul reads by a QArray (qvalue in int8 / float8_e4m3fn, a per-channel scale). The running engine applies the same
  `qwix_quantize_nnx_model` to its loaded model under `jax.jit` (the concrete path): the same trace, so the same
  leaves, which the quantized sync (rollout/vllm_sync.py) writes."""
  from tpu_inference.distributed import jax_parallel_state
  from tpu_inference.models.jax.utils.qwix import qwix_utils

  jax_parallel_state.init_pp_distributed_environment(ip="", rank=0, world_size=1, device=None, need_pp=False)
  rng = jax.random.key(0)
  make = qwix_utils.apply_qwix_quantization(vc, lambda: cls(vc, rng, mesh), rng, mesh, apply_to_abstract_model=True)
  quantized = bool(vc.additional_config.get("quantization"))
  with jax.set_mesh(mesh), compat.for_target(mesh) if quantized else contextlib.nullcontext():
    model = nnx.eval_shape(make)
  graphdef, state = nnx.split(model)

  def concrete(x):
    spec = x.sharding.spec if getattr(x, "sharding", None) is not None else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  return graphdef, jax.tree.map(concrete, state)


def weights_by_dtype(state) -> dict[str, int]:
  """Bytes a device holds of the engine's state, per dtype: a quantized sampler's kernels are in the quantized dtype
  (Qwix's QArray qvalue), its scales and the embedding and head in theirs (what says the weights were quantized)."""
  out: dict[str, int] = {}
  for x in jax.tree.leaves(state):
    name = str(x.dtype)  # a PRNG key leaf's dtype (key<fry>) is no NumPy dtype
    out[name] = out.get(name, 0) + report.per_device_bytes([x])
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kv_pool(vc, mesh: Mesh, weights_bytes: int, other_bytes: int, hbm_bytes: int) -> KvPool:
  """vLLM's KV pool for this engine (module docstring), or the one-line verdict when it cannot hold one request."""
  import torch
  from tpu_inference import utils as tpu_utils
  from tpu_inference.runner.kv_cache import get_attention_page_size_bytes, get_kv_cache_shape_with_mesh
  from vllm.v1.kv_cache_interface import FullAttentionSpec

  mc = vc.model_config
  tp = mesh.shape["model"]
  block = vc.cache_config.block_size
  kv_heads = tpu_utils.get_padded_num_heads(mc.get_total_num_kv_heads(), tp)
  head = tpu_utils.get_padded_head_dim(mc.get_head_size())
  layers = mc.get_num_layers(vc.parallel_config)
  page = get_attention_page_size_bytes(mesh, block, kv_heads, head, mc.dtype, False)
  tdtype = getattr(torch, jnp.dtype(mc.dtype).name)
  specs = {
      f"layer.{i}": FullAttentionSpec(
          block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=tdtype, page_size_padded=int(page)
      )
      for i in range(layers)
  }
  in_use = weights_bytes + other_bytes
  util = vc.cache_config.gpu_memory_utilization
  available = int(mesh.size * hbm_bytes * util - mesh.size * in_use)  # TPUWorker.determine_available_memory
  if available <= 0:
    raise SamplerDoesNotFitError(
        f"the vLLM sampler does not fit: {weights_bytes / GIB:.1f} GiB of weights"
        + (f" + {other_bytes / GIB:.1f} GiB of trainer state" if other_bytes else "")
        + f" per chip exceed hbm_utilization_vllm={util} of {hbm_bytes / GIB:.0f} GiB, leaving no KV cache; "
        f"raise rollout_tensor_parallelism (now {tp}) or hbm_utilization_vllm"
    )
  try:
    (kvc,) = compat.kv_cache_configs(vc, specs, [available])
  except ValueError as e:
    raise SamplerDoesNotFitError(
        f"the vLLM sampler does not fit: vLLM refuses its KV pool ({' '.join(str(e).split())[:220]}); raise "
        f"rollout_tensor_parallelism (now {tp}) or hbm_utilization_vllm (now {util}), or lower max_target_length"
    ) from None
  shape = get_kv_cache_shape_with_mesh(mesh, kvc.num_blocks, block, kv_heads, head, mc.dtype)
  per_device = layers * math.prod(shape) * jnp.dtype(mc.dtype).itemsize // mesh.size
  return KvPool(kvc.num_blocks, block, layers, tuple(shape), mc.dtype, weights_bytes, in_use, available, per_device)


def _metadata(vc, mesh: Mesh, tokens: int, reqs: int, decode: bool):
  """Abstract (input_ids, AttentionMetadata, logits_indices) of one step at the runner's padded shapes."""
  from tpu_inference.layers.common.attention_metadata import AttentionMetadata
  from tpu_inference.runner import utils as runner_utils

  max_reqs = vc.scheduler_config.max_num_seqs
  pages_per_req = -(-vc.model_config.max_model_len // vc.cache_config.block_size)
  rep = NamedSharding(mesh, P())

  def arr(shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)

  md = AttentionMetadata(
      input_positions=arr((tokens,)),
      block_tables=arr((max_reqs * pages_per_req,)),
      seq_lens=arr((max_reqs,)),
      query_start_loc=arr((max_reqs + 1,)),
      request_distribution=arr((3,)),
  )
  del decode  # the distribution's values, not its shape, tell decode from prefill
  logits_rows = runner_utils.get_padded_num_reqs_with_upper_limit(reqs, max_reqs)
  return arr((tokens,)), md, arr((logits_rows,))


def _step_fn(name: str, graphdef, mesh: Mesh):
  """`run_model` then `run_compute_logits` of get_flax_model, traced for the target (tpu_inference_compat)."""

  def step(state, kv_caches, input_ids, md, logits_indices):
    with compat.for_target(mesh):
      model = nnx.merge(graphdef, state)
      kv_caches, hidden, *_ = model(kv_caches, input_ids, md)
      return kv_caches, model.compute_logits(hidden[logits_indices])

  step.__name__ = name  # the compiled module's name (jit_<name>) in XLA's dumps and profiles
  return step


def build(rs, spec, trainer_resident: int, dp_devices: list) -> tuple[list, dict]:
  """([(Program, resident, replaces)], facts) of the vLLM rollout on the sampler; raises the verdict when it can't fit."""
  from tpu_inference.runner import utils as runner_utils
  from tpu_inference import envs as tpu_envs

  scfg = rs.sampler_config
  settings = vllm_config_lib.VllmSettings.from_config(scfg)
  kwargs = vllm_config_lib.vllm_engine_kwargs(settings, len(dp_devices))
  if settings.adapter_route:
    return [], {"not_compiled": [maxtext_route_reason(scfg, kwargs, dp_devices)]}
  tp, dp = kwargs["tensor_parallel_size"], kwargs["data_parallel_size"]
  _, _, module = _native(scfg.model_name)
  import importlib

  cls = getattr(importlib.import_module(f"tpu_inference.models.jax.{module}"), _native(scfg.model_name)[0])
  with tempfile.TemporaryDirectory() as model_dir:
    vc = engine_config(scfg, kwargs, model_dir, weight_format(scfg))
    mesh = replica_mesh(dp_devices, tp)
    graphdef, state = abstract_model(cls, vc, mesh)
  weights = report.per_device_bytes(state)
  by_dtype = weights_by_dtype(state)
  colocated = not rs.disaggregated
  pool = kv_pool(vc, mesh, weights, trainer_resident if colocated else 0, spec.hbm_bytes)
  kv_sh = NamedSharding(mesh, P("data", None, "model"))  # kv_cache.create_kv_caches: (BATCH, KV_CONTEXT, KV_HEAD)
  caches = [jax.ShapeDtypeStruct(pool.layer_shape, pool.dtype, sharding=kv_sh) for _ in range(pool.layers)]

  g = int(scfg.rl.num_generations)
  batch, micro = int(scfg.batch_size), int(scfg.rollout_micro_batch_size)
  per_call = batch if micro <= 0 else min(batch, micro)
  calls = -(-batch // per_call)
  reqs = min(-(-per_call * g // dp), vc.scheduler_config.max_num_seqs)  # one replica's running requests
  prompt = int(scfg.max_prefill_predict_length)
  new_tokens = int(scfg.max_target_length) - prompt
  budget = vc.scheduler_config.max_num_batched_tokens
  paddings = runner_utils.build_token_paddings(
      min_token_size=max(tpu_envs.MIN_TOKEN_BUCKET, 1),
      max_token_size=budget,
      padding_gap=tpu_envs.VLLM_TPU_BUCKET_PADDING_GAP,
  )
  prefill_tokens = runner_utils.get_padded_token_len(paddings, min(budget, reqs * prompt))
  decode_tokens = runner_utils.get_padded_token_len(paddings, reqs)
  prefill_steps = -(-reqs * prompt // budget)
  out = []
  for name, tokens, rows, steps, what in (
      ("vllm_prefill_step", prefill_tokens, min(reqs, max(1, budget // max(prompt, 1))), prefill_steps, "prefill"),
      ("vllm_decode_step", decode_tokens, reqs, max(new_tokens - 1, 0), "decode"),
  ):
    ids, md, logits_idx = _metadata(vc, mesh, tokens, rows, what == "decode")
    out.append(
        (
            Program(
                name=name,
                phase="rollout",
                mesh=mesh,
                fn=_step_fn(name, graphdef, mesh),
                args=(state, caches, ids, md, logits_idx),
                calls_per_step=steps * calls,
                knob=KNOB,
                donate_argnums=(1,),
                note=(
                    f"tpu-inference {cls.__name__}, TP {tp} x DP {dp} (one replica compiled); {tokens} tokens, "
                    f"{rows} requests per {what} step; KV pool {pool.num_blocks} blocks of {pool.block_size}"
                ),
                context_mesh=False,
            ),
            trainer_resident if colocated else 0,
            False,
        )
    )
  facts = {
      "vllm_rollout": {
          "route": f"native {cls.__name__}",
          "weight_format": weight_format(scfg) or jnp.dtype(vc.model_config.dtype).name,
          "weights_gib_per_device_by_dtype": {k: v / GIB for k, v in by_dtype.items()},
          "tensor_parallelism": tp,
          "data_parallelism": dp,
          "max_model_len": vc.model_config.max_model_len,
          "max_num_batched_tokens": budget,
          "max_num_seqs": vc.scheduler_config.max_num_seqs,
          "hbm_utilization_vllm": vc.cache_config.gpu_memory_utilization,
          "requests_per_replica": reqs,
          "prefill_steps_per_call": prefill_steps,
          "decode_steps_per_call": max(new_tokens - 1, 0),
          "rollout_calls_per_step": calls,
          **pool.as_json(),
      },
      "not_compiled": [],
  }
  return out, facts


# HF model_type of the checkpoints of the families MaxText's adapter route serves (the config.json vLLM reads).
_HF_MODEL_TYPE = {"llama3.1": "llama", "qwen3": "qwen3_moe", "mixtral": "mixtral", "gemma3": "gemma3_text"}


def _adapter_mesh(devices: list, tp: int) -> Mesh:
  """The adapter's mesh: tpu-inference's full axis names, `tp` devices on 'model' (tests/tpu_contract's adapter_mesh)."""
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES

  shape = [1] * len(MESH_AXIS_NAMES)
  shape[MESH_AXIS_NAMES.index("model")] = tp
  return Mesh(np.array(devices[:tp], dtype=object).reshape(shape), MESH_AXIS_NAMES)


def maxtext_route_reason(scfg, kwargs: dict, devices: list) -> str:
  """Build MaxText's `MaxTextForCausalLM` abstractly as the native class is; the one `not compiled:` line."""
  from tpu_inference.distributed import jax_parallel_state
  from tpu_inference.layers.common.sharding import ShardingConfigManager
  from tpu_inference.models.common import model_loader
  from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

  kwargs, _ = vllm_maxtext.engine_kwargs(kwargs, vllm_maxtext.AdapterSettings.from_config(scfg))
  head = f"vllm rollout ({vllm_maxtext.ARCHITECTURE}, MaxText's {scfg.model_name} decoder inside vLLM)"
  family = next((k for k in _HF_MODEL_TYPE if scfg.model_name.startswith(k)), None)
  if family is None:
    return f"{head}: no HF model_type known here for {scfg.model_name}; no compiled rollout row"
  try:
    vllm_maxtext.register_adapter()
    cls = model_loader._MODEL_REGISTRY[vllm_maxtext.ARCHITECTURE]  # pylint: disable=protected-access  # as the loader
    with tempfile.TemporaryDirectory() as model_dir:
      hf = {**kwargs["hf_overrides"], "model_type": _HF_MODEL_TYPE[family]}
      hf.setdefault("max_position_embeddings", kwargs["max_model_len"])
      with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f)
      vc = VllmConfig(
          model_config=ModelConfig(
              model=model_dir,
              skip_tokenizer_init=True,
              dtype=kwargs["dtype"],
              max_model_len=kwargs["max_model_len"],
              hf_overrides=kwargs["hf_overrides"],
          ),
          device_config=DeviceConfig(device="cpu"),
          parallel_config=ParallelConfig(tensor_parallel_size=kwargs["tensor_parallel_size"]),
          load_config=LoadConfig(load_format="dummy"),
          additional_config={k: v for k, v in kwargs["additional_config"].items() if k != "sharding"},
      )
      vc.model_config.dtype = model_loader.to_jax_dtype(vc.model_config.dtype)
      vc.sharding_config = ShardingConfigManager.from_vllm_config(vc)
      jax_parallel_state.init_pp_distributed_environment(ip="", rank=0, world_size=1, device=None, need_pp=False)
      mesh = _adapter_mesh(devices, kwargs["tensor_parallel_size"])
      with jax.set_mesh(mesh):
        nnx.eval_shape(lambda: cls(vc, jax.random.key(0), mesh))
  except Exception as e:  # pylint: disable=broad-exception-caught  # the reason is the line
    first = " ".join(str(e).split())[:240]
    return f"{head}: nnx.eval_shape cannot build it, so its step is not compiled ({type(e).__name__}: {first})"
  return f"{head}: built abstractly, but this path compiles only the native classes' step; no compiled rollout row"
