"""`rollout_engine=vllm` compiled for a TPU topology (maxtext_rl_plugin/aot/vllm_programs.py), in the TPU image's stack.

* A tiny Llama 3.1 for v5p-8, rollout programs only (`MAXTEXT_RL_AOT_PHASES=rollout`: the update is
  tests/aot/test_aot.py's): the report has `vllm_prefill_step` and `vllm_decode_step` in the rollout phase with their
  calls per step, the compiled modules hold tpu-inference's Pallas ragged paged attention (a `tpu_custom_call` named
  RPA... per layer, from XLA's own dump), and the KV pool equals the arithmetic written out here from the two
  libraries' sources: per layer a page is block x 2 x kv heads (padded to TP) x head_dim x 2 bytes, and vLLM allocates
  floor(devices x (HBM x hbm_utilization_vllm - bytes in use) / (layers x page)) blocks.
* The same with `rollout_quantization=fp8` (tpu-inference's Qwix PTQ pass on the abstract model): the engine's state
  holds the layers' kernels in float8_e4m3fn, as many bytes as they have parameters (by hand), only the embedding,
  head, norms and scales in bf16, and the compiled decode step takes them as FP8 arguments (XLA's dump).
* A sampler whose weights exceed `hbm_utilization_vllm` of the chip: one `error:` line naming the two knobs, exit 2.
* The private names tpu_inference_compat touches exist at the pins and answer as on the target.

Compiles run in subprocesses with the image's libtpu (.venv-tpu-libtpu, scripts/tpu_contract_venv.sh) on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from maxtext_rl_plugin.aot import tpu_inference_compat as compat

# Before anything imports tpu_inference: its import-time TPU facts come from here, not the GCE metadata server.
compat.quiet_env(os.environ.get("TPU_ACCELERATOR_TYPE", "v5litepod-4"))

REPO = pathlib.Path(__file__).resolve().parents[2]
LIBTPU = REPO / ".venv-tpu-libtpu"
GIB = 1024**3
# A tiny Llama 3.1 (head_dim 128: tpu-inference pads smaller ones), bf16 as vLLM serves it, TP 4 over v5p-8's 4 chips.
TINY = [
    str(REPO / "configs" / "cpu_tiny.yml"),
    "model_name=llama3.1-8b",
    "base_emb_dim=128",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=256",
    "base_num_decoder_layers=2",
    "head_dim=128",
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "rollout_engine=vllm",
    "rollout_tensor_parallelism=4",
    "compile_topology=v5p-8",
]

needs_libtpu = pytest.mark.skipif(
    not (LIBTPU / "libtpu").is_dir(), reason="libtpu 0.0.48 not in .venv-tpu-libtpu (scripts/tpu_contract_venv.sh)"
)


def _compile(tmp_path, *extra, dump=None) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(LIBTPU), MAXTEXT_RL_AOT_PHASES="rollout")
  env.pop("XLA_FLAGS", None)  # the target's devices come from the topology, not forced host devices
  if dump:
    env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=vllm_.*"
  cmd = [sys.executable, "-P", "-m", "maxtext_rl_plugin.compile_rl", *TINY, f"base_output_directory={tmp_path}", *extra]
  return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


@needs_libtpu
def test_tiny_vllm_rollout_compiles_for_v5p_8_with_the_kernel_and_vllms_kv_pool(tmp_path):
  dump = tmp_path / "hlo"
  res = _compile(tmp_path, "run_name=v", "hbm_utilization_vllm=0.5", dump=dump)
  assert res.returncode == 0, res.stderr[-3000:]
  rep = json.loads((tmp_path / "v.aot-v5p-8.json").read_text())
  names = [p["name"] for p in rep["programs"]]
  assert names == ["vllm_prefill_step", "vllm_decode_step"]
  assert all(p["phase"] == "rollout" and p["devices"] == 4 and p["fits"] and p["gflops"] > 0 for p in rep["programs"])
  v = rep["vllm_rollout"]
  # cpu_tiny: batch 2 x 2 generations = 4 requests; prompt 128 of 160 tokens: 32 new tokens, the first from prefill.
  assert v["route"] == "native LlamaForCausalLM" and v["tensor_parallelism"] == 4 and v["requests_per_replica"] == 4
  calls = {p["name"]: p["calls_per_step"] for p in rep["programs"]}
  assert calls == {"vllm_prefill_step": 1, "vllm_decode_step": 31}
  assert rep["step_seconds"]["rollout"] == pytest.approx(sum(p["ms_per_step"] for p in rep["programs"]) / 1e3)
  assert "actor_update: skipped (MAXTEXT_RL_AOT_PHASES=rollout)" in rep["not_compiled"]

  # The KV pool, from the sources' arithmetic (module docstring): kv heads 2 padded to TP 4, head_dim 128, bf16.
  devices, hbm, util = 4, 95 * GIB, 0.5
  page = v["block_size"] * 2 * 4 * 128 * 2
  available = int(devices * hbm * util - devices * v["in_use_gib_per_device"] * GIB)
  assert v["num_blocks"] == available // (v["layers"] * page)
  assert v["layer_shape"] == [v["num_blocks"], v["block_size"], 4, 2, 128]
  assert v["kv_pool_gib_per_device"] == pytest.approx(v["num_blocks"] * page * v["layers"] / devices / GIB)
  # The pool is in the program's HBM need: arguments = weights + pool (+ the step's few int32 inputs).
  for p in rep["programs"]:
    assert p["argument_gib"] == pytest.approx(v["weights_gib_per_device"] + v["kv_pool_gib_per_device"], abs=1e-3)
    assert p["needs_gib"] == pytest.approx(util * 95, abs=0.1)  # colocated: the pool fills what the trainer leaves

  # XLA's dump of each compiled program: one Pallas RPA kernel call (decode and mixed variants) per layer.
  for name in names:
    (text,) = [f.read_text(encoding="utf-8") for f in dump.glob(f"*{name}*after_optimizations.txt")]
    assert text.count('custom_call_target="tpu_custom_call"') >= v["layers"]
    assert "RPAd-" in text and "RPAm-" in text, name


@needs_libtpu
def test_tiny_vllm_rollout_with_fp8_weights_holds_and_reads_them_in_fp8(tmp_path):
  # vocab 512: the embedding and head (left in bf16) no longer dwarf the 2 layers' kernels.
  dump = tmp_path / "hlo"
  res = _compile(
      tmp_path, "run_name=q", "hbm_utilization_vllm=0.5", "rollout_quantization=fp8", "vocab_size=512", dump=dump
  )
  assert res.returncode == 0, res.stderr[-3000:]
  rep = json.loads((tmp_path / "q.aot-v5p-8.json").read_text())
  v = rep["vllm_rollout"]
  assert v["weight_format"] == "fp8"
  held = {k: round(g * GIB) for k, g in v["weights_gib_per_device_by_dtype"].items()}
  # Per device, by hand: q, k, v, o of 4 heads (kv heads 2 padded to TP 4) x head_dim 128 on a 128 model dim, and the
  # MLP's gate, up, down (128 x 256), 2 layers, over TP 4: one byte each in FP8.
  kernels = 2 * (4 * 128 * 4 * 128 + 3 * 128 * 256) // 4
  assert held["float8_e4m3fn"] == kernels
  # Left in bf16: embedding + head (512 x 128 each, over TP 4), norms, the per-channel scales; a kernel left in bf16
  # would add 2 bytes a parameter.
  embed_head = 2 * 512 * 128 * 2 // 4
  assert embed_head <= held["bfloat16"] < embed_head + 0.05 * kernels
  assert v["weights_gib_per_device"] * GIB == pytest.approx(sum(held.values()), abs=16)
  # The pool is vLLM's sizing with these smaller weights (the default test's arithmetic).
  page = v["block_size"] * 2 * 4 * 128 * 2
  assert v["num_blocks"] == int(4 * 95 * GIB * 0.5 - 4 * v["in_use_gib_per_device"] * GIB) // (v["layers"] * page)
  # The compiled decode step takes the 14 FP8 kernels as FP8 arguments, and each is read by a matmul's own fusion (XLA's
  # dump): the read-back to bf16 is fused into the dot, no bf16 copy of a kernel is written.
  (text,) = [f.read_text(encoding="utf-8") for f in dump.glob("*vllm_decode_step*after_optimizations.txt")]
  body = text[text.index("ENTRY") :].split("\n}\n", 1)[0].splitlines()
  f8 = re.findall(r"%(param\.\d+) = f8e4m3fn", "\n".join(body))
  users = [ln for ln in body[1:] if " parameter(" not in ln and any(re.search(rf"%{p}\b[,)]", ln) for p in f8)]
  assert len(f8) == 2 * 7 and users, body[0][:400]
  assert all(" fusion(" in u and "dot_general" in u for u in users), [u[:160] for u in users]
  decode = next(p for p in rep["programs"] if p["name"] == "vllm_decode_step")
  assert decode["gbytes"] * 1e9 >= v["weights_gib_per_device"] * GIB


# ~40 s (a second compile subprocess): the default tier compiles the fitting rollout and checks the KV pool's
# arithmetic; tests/aot/test_aot.py checks the one-line no-fit exit for the embedded programs.
@pytest.mark.extended
@needs_libtpu
def test_a_sampler_that_cannot_hold_its_weights_is_one_line_and_exit_2(tmp_path):
  # 0.02% of 95 GiB is 0.019 GiB: the weights (0.03 GiB a chip) and the colocated trainer's state are already past it.
  # (0.1% held until the update lost its MultiSteps accumulator: the trainer's state is now under 0.095 GiB a chip.)
  res = _compile(tmp_path, "run_name=big", "hbm_utilization_vllm=0.0002")
  assert res.returncode == 2, res.stderr[-3000:]
  err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
  assert len(err) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
  assert "rollout_tensor_parallelism" in err[0] and "hbm_utilization_vllm" in err[0]


def test_the_private_names_compat_touches_exist_at_the_pins():
  from tpu_inference import tpu_info  # pylint: disable=import-outside-toplevel
  from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, tuned_block_sizes  # pylint: disable=import-outside-toplevel

  assert compat.importable()
  # The device-kind answers, by tpu-inference's own parsing, for v5p (device_kind "TPU v5"), v6e and Ironwood.
  for kind, want in (("TPU v5", (5, "TPU v5")), ("TPU v6 lite", (6, "TPU v6e")), ("TPU7x", (7, "TPU v7"))):
    assert compat.target_answers(types.SimpleNamespace(device_kind=kind)) == want
  bound = {(m.__name__, n) for m, n in compat.bindings()}
  assert (kernel.__name__, "get_tpu_version") in bound
  assert {(tuned_block_sizes.__name__, "get_device_name"), (tuned_block_sizes.__name__, "get_tpu_version")} <= bound
  # The environment that stops the metadata-server lookups is what tpu_info reads before it polls.
  src = inspect.getsource(tpu_info)
  assert all(f"envs.{k}" in src for k in ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID"))
  # determine_available_memory's arithmetic (cited in vllm_programs): limit x utilization - used. Read, not imported:
  # the worker module imports vLLM's n-gram proposer, whose numba is not in the image's pins for this venv.
  worker = pathlib.Path(importlib.util.find_spec("tpu_inference.worker.tpu_worker").origin).read_text(encoding="utf-8")
  assert "total_hbm_limit_cap = total_hbm_limit * gpu_memory_utilization" in worker
  assert "total_hbm_avail = int(total_hbm_limit_cap - total_hbm_used)" in worker
  assert compat.batch_defaults() == (8192, 256)  # what vllm.LLM defaults to on a TPU VM at these pins
