"""The programs one RL step executes, built abstractly (shapes and shardings, no weights) from the run's own functions.

Each `Program` is a function, its abstract arguments (`jax.ShapeDtypeStruct`s carrying the run's `NamedSharding`s on
the target's devices) and how often a step runs it. Nothing here reads a checkpoint, a tokenizer or data:

* `actor_update`: the actor trainer's step (`accumulation.train_step`, the body the run's actor trainer jits: one
  optimizer update over a mini-batch, its micro-batches accumulated inside) with the loss the learner registers
  (`tunix_wiring.tunix_policy_loss_fn` via Tunix's function registry, the algo config of
  `tunix_wiring.tunix_algo_config`), the optimizer of `run/build.build_optimizer`, over the model `from_pretrained`
  builds (`model_creation_utils.get_nnx_create_model_fn` on `get_mesh_from_config`'s mesh), LoRA applied by
  MaxText's `apply_lora_to_model` as `run/models.apply_lora` does; at the mini-batch.
* `reference_logps` / `old_logps`: Tunix's `compute_per_token_logps` (stop-gradient) on the trainer mesh, as
  `logps.TrainerLogps` and the reference forward run it, at the micro-batch. On an MoE model the old-policy
  forward is TrainerLogps' own: `moe.forward_logps` over a recording graphdef (routing out, replayed routing in).
* `rollout`: the embedded engine's whole prefill + decode program (`rollout/decode.MaxTextSampler.program`) for
  the compile key a rollout call of the configured batch uses, with its KV cache, on the sampler mesh; on an MoE
  model with routing recorded, as `rollout/embedded.py` builds the engine.
* MoE with `rl.router_replay`: the update's micro-batch is the run's `moe.RoutedTrainExample` (the sampler's routing
  [rows, P + T, MoE layers, k], its shape from the model's own recording forward).
* `weight_sync_stage`: the device_put path's phase 1 (`resharding/move.py`): the trainer's params re-partitioned
  into the sampler's layout on the trainer devices (disaggregated runs with equal device counts only).

pad/eos ids are program constants whose values change no shape or cost: 0 and 1 here (no tokenizer is read).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax

from maxtext.common import train_state_nnx
from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from tunix.rl import common as tunix_common
from tunix.rl import function_registry

from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin.run import accumulation
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.rollout import bucketing
from maxtext_rl_plugin.rollout import decode
from maxtext_rl_plugin.rollout import embedded_spec
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.rollout import stops
from maxtext_rl_plugin.run import build
from maxtext_rl_plugin.run import engine as run_engine
from maxtext_rl_plugin.run import models as run_models

PAD_ID, EOS_ID = 0, 1
DATA_AXIS = ("fsdp",)  # Tunix's TrainingConfig.data_sharding_axis default, which the run keeps


@dataclasses.dataclass
class Program:
  """One program of the step: what to lower, on which mesh, and how often a step runs it."""

  name: str
  phase: str  # rollout | logps | update | sync
  mesh: Mesh
  fn: Callable
  args: tuple
  calls_per_step: int
  knob: str  # the config key that moves its memory
  rules: Any = ()
  in_shardings: Any = None
  out_shardings: Any = None
  donate_argnums: tuple = ()
  note: str = ""
  # Lower under `jax.set_mesh(mesh)` (the run's context); off when inputs and outputs order the devices differently.
  context_mesh: bool = True


def _abstract(x, sharding):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def trainer_mesh(config, devices) -> Mesh:
  """The mesh `from_pretrained(config, devices=...)` builds for the actor (run_models.build_model)."""
  return maxtext_utils.get_mesh_from_config(config, devices)


def _train_state_fn(config, mesh, tx, lora: bool, pad_id: int = PAD_ID) -> Callable[[], Any]:
  """A zero-argument builder of (actor adapter, optimizer), as build_run + Tunix's PeftTrainer make them."""
  create = model_creation_utils.get_nnx_create_model_fn(config, mesh=mesh)

  def init():
    base = create()
    if lora:
      # mesh=None: inside eval_shape the adapters are tracers, which MaxText's replicate step cannot re-place; their
      # sharding metadata (replicated, set by apply_lora_to_model) is what get_abstract_state reads.
      base = run_models.apply_lora_abstract(config, base, None)
    actor = TunixMaxTextAdapter(base_model=base, pad_id=pad_id)
    wrt = nnx.LoRAParam if lora else nnx.Param
    return train_state_nnx.TrainStateNNX(actor, nnx.Optimizer(actor, tx, wrt=wrt))

  return init


def optimizer(config) -> optax.GradientTransformation:
  """The actor's optimizer as the run's trainer holds it: build_optimizer, with no MultiSteps wrapper (build_run
  leaves Tunix's train_micro_batch_size unset; micro-batches accumulate inside the step, accumulation.py)."""
  return build.build_optimizer(config)


def abstract_train_state(config, mesh, lora: bool, pad_id: int = PAD_ID):
  """(graphdef, abstract state, shardings) of the actor + optimizer, as MaxText's train_compile derives them."""
  init = _train_state_fn(config, mesh, optimizer(config), lora, pad_id)
  with decode.warnings_off():
    state, _, shardings = maxtext_utils.get_abstract_state(config, mesh, init, True)
    with logical_axis_rules(config.logical_axis_rules):
      graphdef, _ = nnx.split(nnx.eval_shape(init))
  return graphdef, state, shardings


def replays_routing(config) -> bool:
  """rl.router_replay on an MoE model: the trainer's old-policy and policy forwards get the sampler's routing."""
  return bool(config.rl.router_replay) and moe.MoeSettings.from_config(config).is_moe


def _moe_logps(graphdef, temperature: float):
  """The old-policy forward `logps.TrainerLogps` jits on MoE models: `moe.forward_logps` over a recording
  graphdef (the trainer's routing is an output; `forced` replays the sampler's under rl.router_replay)."""

  def forward(model_state, prompt_ids, completion_ids, forced):
    model = nnx.merge(graphdef, model_state).model
    lp, _, route, _ = moe.forward_logps(
        moe.recording_graphdef(model),
        nnx.state(model),
        prompt_ids,
        completion_ids,
        PAD_ID,
        EOS_ID,
        temperature=temperature,
        forced=forced,
    )
    return lp, route

  return forward


def _routing(config, mesh, graphdef, state, rows: int):
  """Abstract [rows, P + T, MoE layers, k] int32 routing as the model records it (the run's own forward's shape)."""
  ex = _example(config, mesh, rows, 0.0, False)
  with decode.warnings_off(), jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
    _, route = jax.eval_shape(_moe_logps(graphdef, 1.0), state, ex.prompt_ids, ex.completion_ids, None)
  return jax.ShapeDtypeStruct(route.shape, jnp.int32, sharding=distributed.rows_sharding(mesh, DATA_AXIS, route.shape))


def _example(config, mesh, rows: int, beta: float, use_is: bool, routed=None):
  """A Tunix TrainExample of `rows` rows (prompt bucket x completion budget), sharded as Tunix's shard_input does;
  with `routed` (rl.router_replay) the run's `moe.RoutedTrainExample` carrying the sampler's routing (run/experience.py).
  """
  lp, lc = int(config.max_prefill_predict_length), int(config.max_target_length - config.max_prefill_predict_length)

  def arr(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=distributed.rows_sharding(mesh, DATA_AXIS, shape))

  extra = {} if routed is None else {"routed_experts": routed}
  return (tunix_common.TrainExample if routed is None else moe.RoutedTrainExample)(
      prompt_ids=arr((rows, lp), jnp.int32),
      prompt_mask=arr((rows, lp), jnp.int32),
      completion_ids=arr((rows, lc), jnp.int32),
      completion_mask=arr((rows, lc), jnp.int32),
      advantages=arr((rows,), jnp.float32),
      ref_per_token_logps=arr((rows, lc), jnp.float32) if beta else None,
      old_per_token_logps=arr((rows, lc), jnp.float32),
      sampler_is_weights=arr((rows, lc), jnp.float32) if use_is else None,
      **extra,
  )


def loss_fn_of(config, pad_id: int = PAD_ID, eos_id: int = EOS_ID):
  """The loss the GrpoLearner hands the actor trainer: the registry's policy loss with the run's algo config."""
  algo = tunix_wiring.tunix_algo_config(AlgorithmSettings.from_config(config))
  algo.temperature = float(config.decode_sampling_temperature)  # GrpoLearner sets it from the rollout config
  policy_loss_fn = function_registry.get_policy_loss_fn(algo.policy_loss_fn)

  def loss_fn(model, train_example, algo_config):
    return policy_loss_fn(model, train_example, algo_config=algo_config, pad_id=pad_id, eos_id=eos_id)

  return loss_fn, algo


def update_fn(graphdef, config, lora: bool, pad_id: int = PAD_ID, eos_id: int = EOS_ID):
  """The actor update as a pure function of (state, example): the run's train step on the merged module."""
  loss_fn, algo = loss_fn_of(config, pad_id, eos_id)
  return train_step_fn(graphdef, loss_fn, algo, lora, updates.UpdatePlan.from_config(config).accumulation_steps)


def train_step_fn(graphdef, loss_fn, algo, lora: bool, steps: int):
  """The run's train step (`accumulation.train_step` over `steps` micro-batches) with `loss_fn` (and its `algo`
  config) as a pure function of (state, example); the plugin's update and aot/anchor_tunix.py's Tunix-loss update
  differ only in the loss."""

  def gen_input(x):
    return {"train_example": x, "algo_config": algo}

  def step(state, example):
    ts = nnx.merge(graphdef, state)
    loss, aux, grad_norm = accumulation.train_step(
        ts.model, ts.optimizer, example, loss_fn=loss_fn, gen_model_input_fn=gen_input, lora=lora, steps=steps
    )
    return nnx.state(ts), loss, aux, grad_norm

  return step


def actor_update(config, mesh, lora: bool, pad_id: int = PAD_ID, eos_id: int = EOS_ID) -> tuple[Program, Any]:
  """The update program and the abstract train state (shared with the log-prob forwards)."""
  plan = updates.UpdatePlan.from_config(config)
  graphdef, state, shardings = abstract_train_state(config, mesh, lora, pad_id)
  rows = plan.mini_batch_size * plan.num_generations  # one mini-batch per call, its micro-batches accumulated inside
  beta = float(config.rl.grpo_beta)
  routed = _routing(config, mesh, graphdef, state, rows) if replays_routing(config) else None
  example = _example(config, mesh, rows, beta, config.rl.rollout_is != "off", routed)
  ex_sh = jax.tree.map(lambda x: x.sharding, example)
  prog = Program(
      name="actor_update" + ("_lora" if lora else ""),
      phase="update",
      mesh=mesh,
      fn=update_fn(graphdef, config, lora, pad_id, eos_id),
      args=(state, example),
      calls_per_step=plan.updates_per_step,
      knob="train_micro_batch_size (or remat_policy, trainer_devices_fraction)",
      rules=config.logical_axis_rules,
      in_shardings=(shardings, ex_sh),
      out_shardings=(shardings, None, None, None),
      donate_argnums=(0,),
  )
  return prog, (graphdef, state, shardings)


def logps_program(name: str, config, mesh, graphdef, state, calls: int) -> Program:
  """Stop-gradient per-token log-probs of the actor (old policy) or the reference, on the trainer mesh: Tunix's
  `compute_per_token_logps`, or for the old policy of an MoE model `logps.TrainerLogps`' recording forward."""
  plan = updates.UpdatePlan.from_config(config)
  rows = plan.micro_batch_size * plan.num_generations
  ex = _example(config, mesh, rows, 0.0, False)
  temperature = float(config.decode_sampling_temperature) or 1.0
  if name == "old_logps" and moe.MoeSettings.from_config(config).is_moe:
    forced = _routing(config, mesh, graphdef, state, rows) if replays_routing(config) else None
    return Program(
        name=name,
        phase="logps",
        mesh=mesh,
        fn=_moe_logps(graphdef, temperature),
        args=(state, ex.prompt_ids, ex.completion_ids, forced),
        calls_per_step=calls,
        knob="train_micro_batch_size (log-prob micro-batch)",
        rules=config.logical_axis_rules,
        note="MoE: records the trainer's routing" + ("; replays the sampler's" if forced is not None else ""),
    )

  def forward(model_state, prompt_ids, completion_ids):
    ts = nnx.merge(graphdef, model_state)
    gd, st = nnx.split(ts.model)
    return tunix_common.compute_per_token_logps(
        gd,
        st,
        prompt_tokens=prompt_ids,
        completion_tokens=completion_ids,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        stop_gradient=True,
        return_logits=False,
        temperature=temperature,
    )

  return Program(
      name=name,
      phase="logps",
      mesh=mesh,
      fn=forward,
      args=(state, ex.prompt_ids, ex.completion_ids),
      calls_per_step=calls,
      knob="train_micro_batch_size (log-prob micro-batch)",
      rules=config.logical_axis_rules,
  )


def rollout_shape(config, generations: int, dp: int) -> tuple[int, int, int, int]:
  """(prompts per call, prompt bucket, new tokens, calls per step) of the embedded engine for the configured batch."""
  prefill_buckets = list(config.rollout_prefill_buckets or [32, 64, 128, 256, 512, 1024, 2048])
  batch_buckets = list(config.rollout_batch_buckets or [1, 2, 4, 8, 16, 32, 64, 128, 256])
  b = int(config.batch_size)
  micro = int(config.rollout_micro_batch_size)
  per_call = b if micro <= 0 else min(b, micro)
  per_call = min(per_call, max(1, max(*batch_buckets, generations) // generations))
  prompts = bucketing.prefill_batch(bucketing.next_bucket(per_call * generations, batch_buckets), generations, dp)
  length = bucketing.next_bucket(int(config.max_prefill_predict_length), prefill_buckets)
  new_tokens = int(config.max_target_length) - int(config.max_prefill_predict_length)
  return prompts, length, new_tokens, -(-b // per_call)


def rollout_program(sampler_config, sampler_devices) -> Program:
  """The embedded engine's prefill + decode program on the sampler mesh (rollout/decode.py)."""
  mesh = run_models.build_sampler_mesh(sampler_config, sampler_devices)
  with decode.warnings_off():
    # MoE: the engine records each token's experts, as rollout/embedded.py builds it (routing is a program output).
    settings = embedded_spec.EmbeddedSettings.from_config(sampler_config)
    sampler = decode.MaxTextSampler(
        settings.decode,
        run_engine.decode_models(sampler_config, mesh),
        mesh,
        PAD_ID,
        record_routing=settings.record_routing,
    )
    g = int(sampler_config.rl.num_generations)
    prompts, length, new_tokens, calls = rollout_shape(sampler_config, g, sampler.dp)
    spec = sampling.SamplingParams.create(
        sampler_config.decode_sampling_temperature,
        sampler_config.decode_sampling_top_k,
        sampler_config.decode_sampling_nucleus_p,
    ).spec(int(sampler_config.vocab_size))
    stop_arr = stops.stop_id_array([EOS_ID, *[int(t) for t in sampler_config.stop_token_ids or []]])
    key = decode.CompileKey(prompts, g, length, new_tokens, spec, len(stop_arr))
    _, params = model_creation_utils.create_nnx_abstract_model(sampler_config, mesh)
    params = nnx.state(params, nnx.Param)
    ar = sampler.abstract_model(sampler.modes[1])  # the engine's own abstract model
  rest = nnx.to_pure_dict(nnx.state(ar, nnx.Not(nnx.Any(nnx.Param, nnx.Cache))))
  rep = NamedSharding(mesh, P())
  batch = NamedSharding(mesh, P(sampler.batch_axes or None))
  n = prompts * g
  args = (
      params,
      jax.tree.map(lambda x: _abstract(x, rep), rest),
      jax.ShapeDtypeStruct(
          (prompts, length), jnp.int32, sharding=NamedSharding(mesh, P(sampler.batch_axes or None, None))
      ),
      jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=batch),
      jax.ShapeDtypeStruct((n,), jnp.bool_, sharding=batch),
      jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
      jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
      jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
      jax.ShapeDtypeStruct(stop_arr.shape, jnp.int32, sharding=rep),
      jax.ShapeDtypeStruct((stops.MAX_STOP_SEQS, stops.STOP_WINDOW), jnp.int32, sharding=rep),
      None,
  )
  return Program(
      name="rollout_prefill_decode",
      phase="rollout",
      mesh=mesh,
      fn=sampler.program(key),  # the engine's own program for this key
      args=args,
      calls_per_step=calls,
      knob="rollout_micro_batch_size (KV cache: prompts x generations x max_target_length), sampler_devices_fraction",
      rules=sampler.rules,
      note=f"{prompts} prompts x {g} generations, prompt bucket {length}, {new_tokens} new tokens per call",
  )


def sync_program(trainer_params, t_mesh: Mesh, sampler_config, sampler_devices) -> Program | None:
  """Phase 1 of the device_put weight sync: trainer params re-laid out as the sampler's, on the trainer devices.

  The staging mesh lists the trainer devices in the trainer arrays' own device order, as `move._staging_sharding`
  builds it from `x.sharding`, so the program has one device assignment."""
  trainer_devices = list(t_mesh.devices.flat)
  if len(trainer_devices) != len(sampler_devices) or set(trainer_devices) == set(sampler_devices):
    return None
  s_mesh = run_models.build_sampler_mesh(sampler_config, sampler_devices)
  staging_mesh = Mesh(np.array(trainer_devices, dtype=object).reshape(s_mesh.devices.shape), s_mesh.axis_names)
  with decode.warnings_off():
    _, s_model = model_creation_utils.create_nnx_abstract_model(sampler_config, s_mesh)
  dst = nnx.state(s_model, nnx.Param)
  out = jax.tree.map(lambda x: NamedSharding(staging_mesh, x.sharding.spec), dst)
  return Program(
      name="weight_sync_stage",
      phase="sync",
      mesh=staging_mesh,
      fn=lambda xs: xs,
      args=(trainer_params,),
      calls_per_step=1,
      knob="rl.reshard_chunk_size (chunks bound the staging buffers)",
      out_shardings=out,
      note="device_put path, phase 1 (re-partition on the trainer devices); phase 2 is a shard-for-shard copy",
      context_mesh=False,
  )
