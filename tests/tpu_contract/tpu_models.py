"""The real tpu-inference 0.32.0 model classes, built on CPU in .venv-tpu (scripts/tpu_contract_venv.sh).

Runs only in that environment (scripts/test.sh's third pass); tests/conftest.py leaves this directory out of
the main venv's collection. Each model is built from a tiny config.json written here, the way tpu-inference's
`get_flax_model` builds it (VllmConfig, JAX dtype, pp environment, a mesh over its axis names), with 4 forced
CPU devices so tensor parallelism 4 pads the 2 kv heads, as on a TPU slice.
"""

# tpu_inference, vllm and ml_dtypes are imported where used: only .venv-tpu has the first two, and the plugin
# module is imported after the environment above is set.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import importlib
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # else tpu_info polls the GCE metadata server
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

# pylint: disable=wrong-import-position  # jax reads the environment above when it is imported
import jax
import numpy as np

# pylint: enable=wrong-import-position

TP = 4
# hidden 128, 4 query heads, 2 kv heads, head_dim 32 (padded to 128 by tpu-inference), vocab 1001 (not a
# multiple of TP: Qwen3 pads it to 1004).
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1001,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
ARCH = {
    "llama": ("llama3", "LlamaForCausalLM", {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1e6}),
}
# The MaxText model whose HF export tables name the tensors (the plugin maps from these).
MAXTEXT_NAME = {"llama": "llama3.1-8b", "qwen3": "qwen3-0.6b"}

_cache: dict = {}


def build(
    tmp_root, arch: str, *, abstract: bool = True, tp: int = TP, dtype: str = "bfloat16", devices=None, **overrides
):
  """(model, vllm_config, mesh) for the real tpu-inference class of `arch`; concrete weights unless `abstract`;
  on `devices` (default the first `tp`; a per-host engine passes its own process's)."""
  key = (arch, abstract, tp, dtype, json.dumps(overrides, sort_keys=True), tuple(d.id for d in devices or ()))
  if key in _cache:
    return _cache[key]
  from flax import nnx
  from tpu_inference.distributed import jax_parallel_state
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES
  from tpu_inference.models.common.model_loader import to_jax_dtype
  from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

  module, cls_name, extra = ARCH[arch]
  cfg = {**TINY, **extra, **overrides, "architectures": [cls_name]}
  path = tmp_root / f"{arch}-{len(_cache)}"
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(cfg))
  vllm_config = VllmConfig(
      model_config=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=128),
      device_config=DeviceConfig(device="cpu"),
      parallel_config=ParallelConfig(tensor_parallel_size=tp),
  )
  vllm_config.model_config.dtype = to_jax_dtype(vllm_config.model_config.dtype)  # as get_flax_model does
  jax_parallel_state.init_pp_distributed_environment(ip="", rank=0, world_size=1, device=None, need_pp=False)
  shape = [1] * len(MESH_AXIS_NAMES)
  shape[MESH_AXIS_NAMES.index("model")] = tp
  mesh = jax.sharding.Mesh(np.array(list(devices or jax.devices())[:tp]).reshape(shape), MESH_AXIS_NAMES)
  cls = getattr(importlib.import_module(f"tpu_inference.models.jax.{module}"), cls_name)
  with jax.set_mesh(mesh):
    if abstract:
      model = nnx.eval_shape(lambda: cls(vllm_config, jax.random.key(0), mesh))
    else:
      model = cls(vllm_config, jax.random.key(0), mesh)
  _cache[key] = (model, vllm_config, mesh)
  return _cache[key]


def hf_tensors(arch: str, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors, exactly representable in bfloat16, for every HF tensor MaxText's export names."""
  import ml_dtypes
  from maxtext_rl_plugin.rollout import vllm_mapping as vm

  rng = np.random.default_rng(seed)
  return {
      name: rng.standard_normal(shape).astype(ml_dtypes.bfloat16).astype(np.float32)
      for name, shape in vm.vllm_param_shapes(MAXTEXT_NAME[arch], config).items()
  }


def hf_config(**overrides) -> dict:
  """The tiny HF config.json of the contract models, with `overrides`."""
  keys = (
      "vocab_size",
      "hidden_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
      "head_dim",
      "intermediate_size",
      "tie_word_embeddings",
  )
  cfg = {**TINY, **overrides}
  return {k: cfg[k] for k in keys}


# The HF model_type of each MaxText family's checkpoints: the config.json vLLM reads next to the adapter's overrides
# (the adapter itself reads only num_key_value_heads and moe_intermediate_size from it).
HF_MODEL_TYPE = {"llama3.1": "llama", "qwen3": "qwen3_moe", "mixtral": "mixtral", "gemma3": "gemma3_text"}


def adapter_mesh(tp: int) -> jax.sharding.Mesh:
  """A mesh over tpu-inference's axis names with `tp` devices on 'model' (the rollout mesh of an adapter test)."""
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES

  shape = [1] * len(MESH_AXIS_NAMES)
  shape[MESH_AXIS_NAMES.index("model")] = tp
  return jax.sharding.Mesh(np.array(jax.devices()[:tp]).reshape(shape), MESH_AXIS_NAMES)


def build_adapter(tmp_root, family: str, engine_kwargs: dict, mesh: jax.sharding.Mesh):
  """MaxText's `MaxTextForCausalLM` built as vLLM builds it from the plugin's `vllm.LLM` kwargs (hf_overrides,
  additional_config's maxtext_config, dtype, TP), with dummy weights.

  tpu-inference's private loader names, used as the runner uses them (the public `get_model` needs a whole runner):
  `_MODEL_REGISTRY` (where MaxText's `register()` puts the class; the loader's architecture lookup imports gemma4_mm,
  which needs torchvision, not in the pins) and `_get_nnx_model` (the loader's construction of a self-sharding class).
  test_forward_maxtext.py::test_loader_names_exist_at_the_pins checks them.
  """
  from tpu_inference.distributed import jax_parallel_state
  from tpu_inference.layers.common.sharding import ShardingConfigManager
  from tpu_inference.models.common import model_loader
  from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

  hf = {**engine_kwargs["hf_overrides"], "model_type": HF_MODEL_TYPE[family], "max_position_embeddings": 512}
  path = tmp_root / f"adapter-{family}-{len(_cache)}"
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(hf))
  additional = {k: v for k, v in engine_kwargs["additional_config"].items() if k != "sharding"}
  vllm_config = VllmConfig(
      model_config=ModelConfig(
          model=str(path),
          skip_tokenizer_init=True,
          dtype=engine_kwargs["dtype"],
          max_model_len=engine_kwargs["max_model_len"],
          hf_overrides=engine_kwargs["hf_overrides"],
      ),
      device_config=DeviceConfig(device="cpu"),
      parallel_config=ParallelConfig(tensor_parallel_size=engine_kwargs["tensor_parallel_size"]),
      load_config=LoadConfig(load_format=engine_kwargs["load_format"]),
      additional_config=additional,
  )
  vllm_config.model_config.dtype = model_loader.to_jax_dtype(vllm_config.model_config.dtype)
  vllm_config.sharding_config = ShardingConfigManager.from_vllm_config(vllm_config)
  jax_parallel_state.init_pp_distributed_environment(ip="", rank=0, world_size=1, device=None, need_pp=False)
  cls = model_loader._MODEL_REGISTRY["MaxTextForCausalLM"]  # pylint: disable=protected-access
  _cache[("adapter", str(path))] = None
  return model_loader._get_nnx_model(cls, vllm_config, jax.random.key(0), mesh)  # pylint: disable=protected-access
