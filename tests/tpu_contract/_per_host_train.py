"""One process of the two-process `train_rl` with `rollout_engine=vllm` (tests/tpu_contract/test_per_host.py), in
.venv-tpu: `python tests/tpu_contract/_per_host_train.py <process_id> <coordinator> <out.json> <run_root>` (the test
sets JAX_PLATFORMS=cpu and 4 forced host devices).

The whole run is the plugin's: `train_rl.main` as a Ray worker calls it after the worker's `jax.distributed`
initialisation (launch/ray.py), a tiny MaxText Llama 3.1 whose trainer mesh spans both processes, GRPO for 2 steps.
Only vLLM's engine is the stand-in (forward.ShimLLM): each process's `vllm.LLM` is the real tpu-inference
`LlamaForCausalLM` on that process's 4 devices (TP 4), which the plugin's per-host sync fills and whose `generate`
samples through the model's paged KV cache. What this process saw is written as JSON for the test.
"""

import json
import os
import pathlib
import sys

import jax
import vllm

import forward
import tpu_models
from test_forward import LLAMA31_ROPE, TINY_ARGV

VOCAB = 528  # the CPU demo's tokenizer (tests/_tiny.py SMALL_VOCAB): its ids fit the engine's embedding
ARGV = [
    "configs/cpu_tiny.yml",
    *[a for a in TINY_ARGV if not a.startswith(("vocab_size=", "max_prefill_predict_length=", "max_target_length="))],
    "tokenizer_path=tokenizers/arith-bpe-512",
    f"vocab_size={VOCAB}",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    "model_name=llama3.1-8b",
    "head_dim=32",
    "max_prefill_predict_length=48",
    "max_target_length=56",  # 8 new tokens: the stand-in decodes one request at a time, eagerly
    "rollout_engine=vllm",
    "rollout_tensor_parallelism=4",
    "rollout_data_parallelism=2",  # MaxText's meaning: the whole sampler's, 2 hosts x 1 replica
    "rl.verify_weight_sync=every_n",
    "rl.verify_weight_sync_every=1",
    "rl.parity_check=every_n",
    "rl.parity_check_every=1",
    "batch_size=2",
    "rl.num_generations=2",
    "num_batches=2",
    "eval_interval=0",
    "num_test_batches=0",
    "enable_checkpointing=false",
    "metrics_file=metrics.jsonl",  # relative: inside the run's directory
]


def main() -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
  me = jax.process_index()
  local = sorted(jax.local_devices(), key=lambda d: d.id)
  run_root = pathlib.Path(sys.argv[4])
  engine, _, engine_mesh = tpu_models.build(
      run_root / f"engine-p{me}",
      "llama",
      abstract=False,
      dtype="float32",
      vocab_size=VOCAB,
      devices=local,
      head_dim=32,
      rope_scaling=LLAMA31_ROPE,
      tie_word_embeddings=False,
  )
  built = []

  class HostEngine(forward.ShimLLM):
    """This process's engine, recording the kwargs the plugin built it with."""

    model = engine
    mesh = engine_mesh

    def __init__(self, **kwargs):
      built.append(kwargs)
      super().__init__(**kwargs)

  vllm.LLM = HostEngine
  os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
  from maxtext_rl_plugin import train_rl  # pylint: disable=import-outside-toplevel  # after the stand-in is in place

  run_dir = run_root / "runs"
  rc = train_rl.main([*ARGV, f"base_output_directory={run_dir}", "run_name=per_host_vllm"])
  records = []
  metrics = run_dir / "per_host_vllm" / "metrics.jsonl"
  if me == 0 and metrics.exists():
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
  out = {
      "process": me,
      "rc": rc,
      "engines": len(built),
      "device_indexes": [k["additional_config"]["sharding"]["sharding_strategy"]["device_indexes"] for k in built],
      "local_ids": [d.id for d in local],
      "records": records,
  }
  with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
