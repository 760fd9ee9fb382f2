"""One process of the two-process per-host vLLM contract (tests/tpu_contract/test_per_host.py), in .venv-tpu:
`python tests/tpu_contract/_per_host_engine.py <process_id> <coordinator> <out.json> <model_dir>` (the test sets
JAX_PLATFORMS=cpu and 4 forced host devices).

4 CPU devices per process, gloo collectives. The trainer is a tiny MaxText Llama 3.1 on a mesh over all 8 devices
(every process holds half of each FSDP-sharded weight); each process runs the real tpu-inference `LlamaForCausalLM`
on its own 4 devices (TP 4) behind forward.ShimLLM, built by `VllmRollout` from a config whose rollout mesh is the
trainer's (colocated, as a TPU VM without Pathways runs it). What this process saw is written as JSON for the test.
"""

import json
import os
import pathlib
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tunix.rl.rollout import base_rollout
import vllm

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.resharding import trees
from maxtext_rl_plugin.rollout import vllm as vllm_rollout
from maxtext_rl_plugin.rollout import vllm_config
from maxtext_rl_plugin.rollout import vllm_mapping

import forward
import tpu_models
from test_forward import LLAMA31_ROPE, TINY_ARGV, gap

PROMPT_LEN = 24  # RoPE scaling is test_forward.py's concern; here the per-host sync is, and time is pass 3's
N_DECODE = 2


def maxtext_forward(actor, mesh, tokens: list[int]) -> np.ndarray:
  """MaxText's forward of the global trainer weights (a program over all 8 devices), read back on this process."""
  ids = distributed.replicated(np.asarray([tokens], np.int32), mesh)
  pos = distributed.replicated(np.arange(len(tokens), dtype=np.int32)[None], mesh)
  logits = nnx.jit(lambda m, i, p: m(i, p, None, None)[0])(actor, ids, pos)
  return distributed.to_host(logits)[0].astype(np.float32)


def train_step(actor, mesh, tokens: list[int]) -> None:
  """One real Adam step of next-token cross-entropy on the global trainer weights (every process joins)."""
  ids = distributed.replicated(np.asarray([tokens], np.int32), mesh)
  pos = distributed.replicated(np.arange(len(tokens), dtype=np.int32)[None], mesh)
  optimizer = nnx.Optimizer(actor, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, ids, pos):
    def loss_fn(m):
      logits, _ = m(ids[:, :-1], pos[:, :-1], None, None)
      return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()

    opt.update(model, nnx.grad(loss_fn)(model))

  step(actor, optimizer, ids, pos)


def main() -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
  me = jax.process_index()
  local = sorted(jax.local_devices(), key=lambda d: d.id)
  cfg = load_config(
      [
          "configs/cpu_tiny.yml",
          *TINY_ARGV,
          "model_name=llama3.1-8b",
          "head_dim=32",
          "rollout_tensor_parallelism=4",
          "rollout_data_parallelism=2",  # MaxText's meaning: the whole sampler's, 2 hosts x 1 replica
          "rl.verify_weight_sync=every_n",
          "rl.verify_weight_sync_every=1",
      ]
  )
  actor, trainer_mesh = models.build_model(cfg, jax.devices())
  engine, _, engine_mesh = tpu_models.build(
      pathlib.Path(sys.argv[4]) / f"p{me}",
      "llama",
      abstract=False,
      dtype="float32",
      vocab_size=1024,
      devices=local,
      head_dim=32,
      rope_scaling=LLAMA31_ROPE,
      tie_word_embeddings=False,
  )
  # Laid out as tpu-inference's loader lays a model out (`_get_nnx_model`: the partition specs of its metadata), so
  # within a host the engine's weights are TP-sharded and the relayout must hand every device its own shard.
  state = nnx.state(engine)
  nnx.update(engine, jax.device_put(state, nnx.get_named_sharding(state, engine_mesh)))
  forward.ShimLLM.model = engine
  vllm.LLM = forward.ShimLLM
  os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
  rollout = vllm_rollout.VllmRollout(
      rollout_actor=actor,
      tokenizer=tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(cfg)),
      mesh=trainer_mesh,  # colocated: the rollout mesh is the trainer's, over both hosts
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=112),
      settings=vllm_config.VllmSettings.from_config(cfg),
  )
  kw = rollout.engine_kwargs
  out: dict = {
      "process": me,
      "local_ids": [d.id for d in local],
      "device_indexes": kw["additional_config"]["sharding"]["sharding_strategy"]["device_indexes"],
      "tp_dp": [kw["tensor_parallel_size"], kw["data_parallel_size"]],
      "per_host": rollout.per_host,
      "trainer_global": not jax.tree.leaves(nnx.state(actor, nnx.Param))[0].is_fully_addressable,
      "engine_local": all(
          set(v.sharding.device_set) <= set(local) for v in vllm_mapping.engine_weights(nnx.state(engine)).values()
      ),
      "engine_sharded": sorted(
          k for k, v in vllm_mapping.engine_weights(nnx.state(engine)).items() if not v.sharding.is_fully_replicated
      ),
  }
  prompt = [int(t) for t in np.random.default_rng(7).integers(0, 1024, PROMPT_LEN)]

  def check(what: str) -> None:
    got, tokens = forward.engine_greedy(engine, engine_mesh, prompt, N_DECODE)
    want = maxtext_forward(actor, trainer_mesh, prompt + tokens[:-1])
    out[what] = {
        "gap": gap(got, want),
        "tokens": tokens,
        "maxtext_greedy": [int(t) for t in np.argmax(want[len(prompt) - 1 :], axis=-1)],
    }
    print(f"host {me} {what}: gap {out[what]['gap']:.2e}, tokens {tokens}", flush=True)

  def sync() -> str | None:
    try:
      rollout.update_params(nnx.state(actor, nnx.Param), (nnx.Param,))
    except trees.WeightSyncError as e:
      return str(e)
    return None

  check("first_sync")
  train_step(actor, trainer_mesh, prompt)
  check("before_resync")  # the engine still holds the first weights: it must differ from the stepped trainer
  out["resync"] = sync()
  check("after_step")

  # Same-shape mutations the guard must catch (every process joins every collective; only the local part is wrong).
  train_step(actor, trainer_mesh, prompt)
  real_setter = vllm_mapping.engine_state_setter
  if me == 0:  # a stale second sync: host 0's engine keeps the previous weights
    vllm_mapping.engine_state_setter = lambda state: (lambda new: None)
  out["stale"] = sync()
  vllm_mapping.engine_state_setter = real_setter
  real_shards = per_host.local_shards
  if me == 1:  # host 1's engine devices given the shards meant for its other devices

    def rotated(y):
      shards = real_shards(y)
      return [jax.device_put(shards[(i + 1) % len(shards)], s.device) for i, s in enumerate(y.addressable_shards)]

    per_host.local_shards = rotated
  out["wrong_shards"] = sync()
  per_host.local_shards = real_shards
  if me == 1:  # host 1 given rows that are not its copy's: the embedding rolled by half (host 0's half on it)

    def rolled_setter(state):
      def write(new):
        new = dict(new)
        if "model.embed.embedding" in new:
          new["model.embed.embedding"] = jnp.roll(new["model.embed.embedding"], 512, axis=0)
        real_setter(state)(new)

      return write

    vllm_mapping.engine_state_setter = rolled_setter
  out["other_rows"] = sync()
  vllm_mapping.engine_state_setter = real_setter
  out["clean_again"] = sync()

  distributed.barrier("done")
  with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
