"""A forward pass of the real tpu-inference 0.32.0 classes on CPU, fed by the plugin's own vLLM weight sync.

What is real: the tpu-inference model class (its layers, RoPE, padding, GQA, paged KV cache layout, `compute_logits`),
the plugin's `VllmRollout.update_params` (MaxText's export tables, the layout/padding mapping, the writes into the
engine's state), the MaxText model it syncs from. What is not:

* vLLM's engine/scheduler (`vllm.LLM`): `ShimLLM` stands in for it, but its driver worker is tpu-inference's own
  `TPUWorker` over a `TPUModelRunner` holding the real model as `load_model` leaves it (`state` from `nnx.split`,
  `model`), so `get_weights_state()` is the library's (`rl/raiden_worker_sync.extract_weight_state`: a MaxText model's
  weights come as `{"base": state["model"]}`) and `collective_rpc` runs the worker's real methods through vLLM's own
  `run_method`; only the runner's KV-cache allocation is left out (the test drives its own caches); the test drives
  the model;
* the Pallas ragged paged attention kernel, which cannot run on CPU (not even in interpret mode: its `ref.bitcast`
  views): `reference_attention` swaps `attention_interface.sharded_ragged_paged_attention` -- the one function
  `rpa_attention` looks up at call time -- for the package's own pure-JAX reference of that kernel
  (`kernels/ragged_paged_attention/v3/kernel.py::ref_ragged_paged_attention`, `kernel_hd64.py` for head_dim 64):
  same arguments, writes the new k/v into the pages and reads them back. This is the only substitution. The
  reference validates concrete values, so the model runs eagerly (no jit).

MaxText's own decoder inside vLLM (`MaxTextForCausalLM`, test_forward_maxtext.py) needs three more, each narrow:

* MaxText wraps every decoder layer in `jax.checkpoint`, so the attention metadata reaches the reference kernel as
  tracers; `reference_attention` hands the reference the concrete metadata of the step being run (the same values);
* `cpu_fused_moe`: MaxText's MoE under `attention=vllm_rpa` always runs tpu-inference's `fused_moe_func`, whose grouped
  matmul is tokamax's `gmm_v2` Pallas kernel (refuses the CPU device): `fused_moe_gmm.gmm_wrapper` is replaced by
  `reference_gmm`, the computation tokamax's own gmm_v2 test checks the kernel against (per-group matmul; with a fused
  activation, act(first half) * second half); and `dense_gather_reduce.is_compatible` (queries the TPU's SparseCore)
  answers False, which is the library's own JAX fallback for TPUs without a compatible SparseCore.
"""

# tpu_inference and vllm exist only in .venv-tpu; imported where used (see tpu_models.py).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import types
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

PAGE_SIZE = 16
# The concrete attention metadata of the step being run (see the module docstring).
_STEP_METADATA: dict[str, Any] = {}


@contextlib.contextmanager
def reference_attention():
  """Run tpu-inference's attention through the package's pure-JAX reference kernel (module docstring)."""
  from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, kernel_hd64
  from tpu_inference.layers.common import attention_interface
  from tpu_inference.layers.common.sharding import ShardingAxisName
  from tpu_inference.utils import get_mesh_shape_product

  real = attention_interface.sharded_ragged_paged_attention

  def reference(  # the signature of sharded_ragged_paged_attention (0.32.0)
      mesh,
      q,
      k,
      v,
      kv_cache,
      kv_lens,
      page_indices,
      cu_q_lens,
      distribution,
      attention_sink,
      sm_scale,
      attention_chunk_size=None,
      q_scale=None,
      k_scale=None,
      v_scale=None,
      update_kv_cache=True,
      use_causal_mask=True,
      attn_logits_soft_cap=None,
      decode_query_size=1,
  ):
    del decode_query_size  # a block-size knob of the kernel, not numerics
    if any(isinstance(x, jax.core.Tracer) for x in (kv_lens, page_indices, cu_q_lens, distribution)):
      # under MaxText's per-layer jax.checkpoint: the same values, concrete
      kv_lens, page_indices, cu_q_lens, distribution = _STEP_METADATA["concrete"]
    if not update_kv_cache:
      raise NotImplementedError("the reference kernel always writes the cache (KV-share is not exercised here)")
    tp = get_mesh_shape_product(mesh, ShardingAxisName.ATTN_HEAD)
    if 1 < tp and k.shape[1] < tp:  # as the real function: kv heads repeated up to the TP size before sharding
      k, v = jnp.repeat(k, tp // k.shape[1], axis=1), jnp.repeat(v, tp // k.shape[1], axis=1)
    common = {"sm_scale": sm_scale, "sliding_window": attention_chunk_size, "soft_cap": attn_logits_soft_cap}
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution)
    if q.shape[-1] == 64:
      out, kv_cache = kernel_hd64.ref_ragged_paged_attention_hd64(*args, attention_sink, **common, **scales)
    else:
      if attention_sink is not None:
        raise NotImplementedError("attention sinks exist only on the head_dim 64 kernel")
      out, kv_cache = kernel.ref_ragged_paged_attention(*args, use_causal_mask=use_causal_mask, **common, **scales)
    # The reference returns rows for the real tokens only; the kernel returns all T rows.
    return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0))), kv_cache

  attention_interface.sharded_ragged_paged_attention = reference
  try:
    yield
  finally:
    attention_interface.sharded_ragged_paged_attention = real


def reference_gmm(lhs, rhs, rhs_scale, rhs_bias, group_sizes, group_offset, fuse_act=None, preferred_element_type=None):
  """`fused_moe_gmm.gmm_wrapper` (tokamax gmm_v2) as tokamax's own test reference computes it, traceable: rows are
  grouped by `group_sizes` (global groups, `group_offset` the first local one); rows outside the local groups are 0."""
  from tokamax._src.ops.experimental.gmm_v2 import gmm_v2  # pylint: disable=no-name-in-module  # .venv-tpu's tokamax

  if rhs_scale is not None:
    raise NotImplementedError("quantized experts are not exercised on CPU")
  out_dtype = preferred_element_type or lhs.dtype
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right") - jnp.asarray(group_offset).reshape(-1)[0]
  local = (group >= 0) & (group < rhs.shape[0])
  per_group = jnp.einsum("mk,gkn->gmn", lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  out = jnp.take_along_axis(per_group, jnp.clip(group, 0, rhs.shape[0] - 1)[None, :, None], axis=0)[0]
  if rhs_bias is not None:
    out = out + rhs_bias.astype(jnp.float32)[jnp.clip(group, 0, rhs.shape[0] - 1)].reshape(out.shape[0], -1)
  out = jnp.where(local[:, None], out, 0.0)
  if fuse_act is not None:  # gmm_v2.apply_act_fn's table, without its TPU lane (de)interleave around it
    gate, up = jnp.split(out, 2, axis=-1)
    acts = {
        "silu": lambda g, u: jax.nn.silu(g) * u,
        "gelu": lambda g, u: jax.nn.gelu(g) * u,
        "gelu_tanh": lambda g, u: jax.nn.gelu(g, approximate=True) * u,
        "swigluoai": gmm_v2.swigluoai,
    }
    out = acts[fuse_act](gate, up)
  return out.astype(out_dtype)


@contextlib.contextmanager
def cpu_fused_moe():
  """tpu-inference's fused MoE on CPU: the grouped-matmul kernel by its reference, no SparseCore (module docstring)."""
  from tpu_inference.kernels.sparse_core import dense_gather_reduce
  from tpu_inference.layers.common import fused_moe_gmm

  real = fused_moe_gmm.gmm_wrapper, dense_gather_reduce.is_compatible
  fused_moe_gmm.gmm_wrapper = reference_gmm
  dense_gather_reduce.is_compatible = lambda *a, **k: False
  try:
    yield
  finally:
    fused_moe_gmm.gmm_wrapper, dense_gather_reduce.is_compatible = real


def real_worker(model) -> Any:
  """tpu-inference's own `TPUWorker` whose runner holds `model` as `TPUModelRunner.load_model` leaves it.

  The runner's `state` is `nnx.split` of the model (`model_loader.get_flax_model`; its Variables alias the model's)
  and `model` the module, so the worker's `get_weights_state`, `refresh_model_state_leaves` and
  `start/finish_weight_update` are the library's code at the pin. Neither object runs `__init__` (that boots a device
  and vLLM's engine); the runner's KV-cache allocation is the one piece replaced: the test drives its own caches.
  """
  from tpu_inference.runner.tpu_runner import TPUModelRunner
  from tpu_inference.worker.tpu_worker import TPUWorker

  runner = object.__new__(TPUModelRunner)
  _, runner.state = nnx.split(model)
  runner.model = model
  runner.refresh_state_leaves()
  runner.kv_cache_events = []
  runner.delete_kv_cache = lambda: runner.kv_cache_events.append("delete")
  runner.reinitialize_kv_cache = lambda: runner.kv_cache_events.append("reinitialize")
  worker = object.__new__(TPUWorker)
  worker.model_runner = runner
  vars(worker).update(_weight_update_active=False, _kv_cache_freed=False)  # TPUWorker.__init__'s session state
  return worker


class ShimLLM:
  """`vllm.LLM` at the hardware boundary: no engine or scheduler, but tpu-inference's real worker (`real_worker`).

  Every method it has, `vllm.LLM` has with the same parameters (test_shim_contract.py).
  """

  model: Any = None  # set per test (the real tpu-inference model)
  mesh: Any = None  # its mesh, for `generate`
  pad_to: int = 1  # the runner's token bucket multiple (16 for the fused-MoE kernel)
  seed: int = 0

  def __init__(self, **kwargs):
    self.kwargs = kwargs
    self.llm_engine = types.SimpleNamespace(
        model_executor=types.SimpleNamespace(driver_worker=real_worker(type(self).model))
    )

  def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
    del reset_running_requests, reset_connector  # the prefix cache is the scheduler's; there is none here
    return True

  def generate(
      self,
      prompts,
      sampling_params=None,
      *,
      use_tqdm=True,
      lora_request=None,
      priority=None,
      tokenization_kwargs=None,
      mm_processor_kwargs=None,
  ):
    """`vllm.LLM.generate` for token prompts, one request at a time through the real model's paged KV cache
    (`engine_greedy`), sampled as vLLM's sampler samples for the plugin's settings (temperature, no top-k / top-p),
    answered in vLLM's own `RequestOutput` / `CompletionOutput` / `Logprob` with `processed_logprobs` (the engine's
    `logprobs_mode`: after temperature), the finish reason vLLM gives, and, when the engine was built with
    `enable_return_routed_experts`, the routing vLLM's and tpu-inference's capture code returns
    (`vllm_routed_experts`). What the stand-in does not do (stop strings, top-k / top-p, LoRA requests) raises."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    del use_tqdm, priority, tokenization_kwargs, mm_processor_kwargs
    sp = sampling_params
    if lora_request is not None or sp.stop or sp.top_k not in (0, -1) or sp.top_p < 1.0:
      raise NotImplementedError("the vLLM stand-in samples without stop strings, top-k, top-p or LoRA requests")
    capture = bool(self.kwargs.get("enable_return_routed_experts"))
    experts = int(self.model.vllm_config.model_config.get_num_experts()) if capture else 0
    temperature = float(sp.temperature)
    stops = set(sp.stop_token_ids or ())
    outputs = []
    for n, prompt in enumerate(prompts):
      ids = [int(t) for t in prompt["prompt_token_ids"]]
      rng = np.random.default_rng((type(self).seed, len(outputs), *ids[-4:]))
      type(self).seed += 1

      def pick(row, rng=rng):
        if temperature <= 0:
          return int(np.argmax(row))
        z = row.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        return int(rng.choice(len(p), p=p / p.sum()))

      steps = [] if capture else None
      rows, tokens = engine_greedy(
          self.model, self.mesh, ids, int(sp.max_tokens) - 1, self.pad_to, steps=steps, pick=pick, stop_ids=stops
      )
      chosen = np.asarray(rows[len(ids) - 1 :], np.float64) / (temperature if temperature > 0 else 1.0)
      chosen -= chosen.max(-1, keepdims=True)
      logps = chosen - np.log(np.exp(chosen).sum(-1, keepdims=True))
      logprobs = [{t: Logprob(logprob=float(logps[j, t]), rank=1)} for j, t in enumerate(tokens)]
      stopped = tokens[-1] in stops
      comp = CompletionOutput(
          index=0,
          text="",
          token_ids=tokens,
          cumulative_logprob=float(sum(lp[t].logprob for lp, t in zip(logprobs, tokens))),
          logprobs=logprobs,
          routed_experts=vllm_routed_experts(steps, len(ids), experts) if capture else None,
          finish_reason="stop" if stopped else "length",
          stop_reason=None,
      )
      outputs.append(RequestOutput(str(n), None, ids, None, [comp], finished=True))
    return outputs

  def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
    """As vLLM's in-process executor: the worker's method run by vLLM's own `run_method`, one result per worker."""
    from vllm.v1.serial_utils import run_method

    del timeout
    return [run_method(self.llm_engine.model_executor.driver_worker, method, tuple(args), dict(kwargs or {}))]


def engine_greedy(
    model,
    mesh,
    prompt: list[int],
    n_decode: int,
    pad_to: int = 1,
    *,
    prefill_split: int = 0,
    steps: list | None = None,
    pick=None,
    stop_ids=(),
) -> tuple[np.ndarray, list[int]]:
  """Prefill `prompt` then `n_decode` greedy decode steps through the paged KV cache of the real model.

  Returns (logits [len(prompt) + n_decode, vocab] -- every prefill row, then one row per decode step -- and the
  n_decode + 1 greedy tokens). Positions/pages as vLLM's runner lays them out for one request; each step's tokens are
  padded to a multiple of `pad_to` as the runner's token buckets pad them (the fused-MoE kernel needs tokens x top-k
  to be a multiple of 16): the metadata covers the real tokens only. `prefill_split` > 0 prefills in two chunks, as
  vLLM's chunked prefill schedules a long prompt (the first chunk samples nothing). `steps`, when given, receives one
  dict per engine step: what the runner hands tpu-inference's routed-experts capture (`vllm_routed_experts`). `pick`
  turns a logits row into the next token (argmax by default; ShimLLM.generate samples); decoding stops early after a
  token in `stop_ids`.
  """
  from tpu_inference.kernels.ragged_paged_attention.v3 import kernel
  from tpu_inference.layers.common.attention_metadata import AttentionMetadata

  cfg = model.vllm_config.model_config.hf_config
  vocab = int(cfg.vocab_size)
  dtype = model.vllm_config.model_config.dtype
  max_len = len(prompt) + n_decode
  pages = -(-max_len // PAGE_SIZE)
  tp = int(mesh.shape["model"])
  kv_heads = max(int(cfg.num_key_value_heads), tp)
  head_dim = int(getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
  padded_hd = head_dim if head_dim == 64 else -(-head_dim // 128) * 128
  if padded_hd == 64:
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64

    shape = kernel_hd64.get_kv_cache_shape(pages + 1, PAGE_SIZE, kv_heads, padded_hd, dtype)
  else:
    shape = kernel.get_kv_cache_shape(pages + 1, PAGE_SIZE, kv_heads, padded_hd, dtype)
  kv_caches = [jnp.zeros(shape, dtype) for _ in range(int(cfg.num_hidden_layers))]
  block_tables = jnp.arange(1, pages + 1, dtype=jnp.int32)  # page 0 left unused: a wrong page index shows

  def step(ids: list[int], start: int, distribution: list[int]):
    nonlocal kv_caches
    n = len(ids)
    padded = -(-n // pad_to) * pad_to
    positions = np.zeros(padded, np.int32)
    positions[:n] = np.arange(start, start + n)
    md = AttentionMetadata(
        input_positions=jnp.asarray(positions),
        block_tables=block_tables,
        seq_lens=jnp.asarray([start + n], jnp.int32),
        query_start_loc=jnp.asarray([0, n], jnp.int32),
        request_distribution=jnp.asarray(distribution, jnp.int32),
    )
    # NumPy: under a trace even a jnp op on a concrete array is staged out, and the reference compares the values.
    _STEP_METADATA["concrete"] = tuple(
        np.asarray(x) for x in (md.seq_lens, md.block_tables, md.query_start_loc, md.request_distribution)
    )
    with jax.set_mesh(mesh), reference_attention(), cpu_fused_moe():
      kv_caches, hidden, _, expert_indices = model(kv_caches, jnp.asarray(list(ids) + [0] * (padded - n), jnp.int32), md)
      logits = np.asarray(model.compute_logits(hidden), np.float32)[:n, :vocab]
    if steps is not None:
      steps.append(
          {
              "expert_indices": None if expert_indices is None else np.asarray(expert_indices),  # (layers, padded, k)
              "num_scheduled": n,
              "padded": padded,
              "num_computed": start,
              "block_ids": [int(b) for b in np.asarray(block_tables)],
          }
      )
    return logits

  rows = []
  if prefill_split:  # chunked prefill: the first chunk computes and caches, the second samples
    rows.append(step(prompt[:prefill_split], 0, [0, 0, 1]))
    if steps is not None:
      steps[-1]["sampled"] = False
  rows.append(step(prompt[prefill_split:], prefill_split, [0, 0, 1]))  # one prefill request ("mixed" group)
  pick = pick or (lambda row: int(np.argmax(row)))
  tokens = [pick(rows[-1][-1])]
  for i in range(n_decode):
    if tokens[-1] in stop_ids:
      break
    rows.append(step([tokens[-1]], len(prompt) + i, [1, 1, 1]))  # one decode-only request
    tokens.append(pick(rows[-1][-1]))
  return np.concatenate(rows, axis=0), tokens


def vllm_routed_experts(steps: list[dict], prompt_len: int, num_experts: int) -> np.ndarray:
  """`CompletionOutput.routed_experts` of one request whose engine steps were `steps` (`engine_greedy`), built by the
  libraries' own code at the pins: vLLM's scheduler-side `AuxOutputSchedulerConnector` (per-step metadata, then
  `take_output` once each sampled token is appended, as `Scheduler.update_from_output` orders it), tpu-inference's
  runner split `_routed_experts_step_entries` and its `TPUAuxOutputWorker` (rows stored per physical KV slot, read
  back from the emit cursor), and the output processor's concatenation of the chunks. Only the request and scheduler
  output records are plain namespaces carrying the fields those functions read."""
  from tpu_inference.runner.routed_experts import TPUAuxOutputWorker
  from tpu_inference.runner.tpu_runner import _routed_experts_step_entries  # pylint: disable=protected-access
  from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

  rid = "req-0"
  blocks = steps[0]["block_ids"]
  config = types.SimpleNamespace(model_config=types.SimpleNamespace(get_num_experts=lambda: num_experts))
  worker = TPUAuxOutputWorker(config, types.SimpleNamespace(num_blocks=max(blocks) + 1), PAGE_SIZE, dp_size=1)
  connector = AuxOutputSchedulerConnector()
  request = types.SimpleNamespace(
      request_id=rid,
      block_hashes=[],
      sampling_params=types.SimpleNamespace(routed_experts_prompt_start=0),
      num_prompt_tokens=prompt_len,
      num_output_tokens=0,
      num_tokens=prompt_len,
      is_finished=lambda: False,
  )
  chunks = []
  for st in steps:
    new = st["num_computed"] == 0
    out = types.SimpleNamespace(
        num_scheduled_tokens={rid: st["num_scheduled"]},
        scheduled_new_reqs=[types.SimpleNamespace(req_id=rid, num_computed_tokens=0)] if new else [],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[] if new else [rid], num_computed_tokens=[] if new else [st["num_computed"]]
        ),
        scheduled_spec_decode_tokens={},
    )
    worker.begin_step(connector.build_connector_meta(out, {rid: request}))
    sampled = st.get("sampled", True)
    entries = _routed_experts_step_entries(
        types.SimpleNamespace(dp_size=1),
        out,
        st["expert_indices"],
        [rid],
        [[0]] if sampled else [[]],
        {0: [rid]},
        st["padded"],
        {rid: blocks},
    )
    aux = worker.process_step([rid], entries)
    if sampled:  # the scheduler appends the sampled token, then takes the rows up to num_tokens - 1
      request.num_output_tokens += 1
      request.num_tokens += 1
      chunk = connector.take_output(request, aux)
      if chunk is not None:
        chunks.append(chunk)
  return np.concatenate(chunks, axis=0)


def parity_figures(engine: np.ndarray, trainer: np.ndarray, prompt_len: int, tokens: list[int]) -> dict[str, float]:
  """The parity gate's figures (run/parity.py) on a vLLM route: the log-probs the engine gave its own greedy `tokens`
  (log-softmax of its logits rows from the prompt's last position on, as vLLM reports `logprobs`) against the trainer's
  forward over the same tokens, through the gate's own `figures`."""
  from maxtext_rl_plugin.run import parity  # pylint: disable=import-outside-toplevel

  def chosen(logits):
    rows = np.asarray(logits[prompt_len - 1 : prompt_len - 1 + len(tokens)], np.float64)
    lp = rows - rows.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    return lp[np.arange(len(tokens)), tokens][None]

  return parity.figures(chosen(engine), chosen(trainer), np.ones((1, len(tokens)), bool))


def maxtext_logits(actor, tokens: list[int]) -> np.ndarray:
  """MaxText's own forward (the TunixMaxTextAdapter the trainer holds) over `tokens`: [len, vocab] float32."""
  ids = jnp.asarray([tokens], jnp.int32)
  pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
  logits, _ = actor(ids, pos, None, None)
  return np.asarray(logits[0], np.float32)


def train_step(actor, tokens: list[int], wrt: Any = nnx.Param, learning_rate: float = 1e-2) -> None:
  """One Adam step of next-token cross-entropy on `tokens`, on the `wrt` variables of the MaxText actor."""
  ids = jnp.asarray([tokens], jnp.int32)
  pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
  optimizer = nnx.Optimizer(actor, optax.adam(learning_rate), wrt=wrt)

  def loss_fn(model):
    logits, _ = model(ids[:, :-1], pos[:, :-1], None, None)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()

  _, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(actor)
  optimizer.update(actor, grads)
