"""The `vllm.LLM` stand-in (forward.ShimLLM) against the real classes it stands beside, at the pins.

The stand-in exists because vLLM's engine cannot boot on CPU. Everything the plugin's weight sync touches through it
must be the library's own code, or the stand-in repeats the plugin's assumptions: the first sync of the
MaxTextForCausalLM route once passed against a stand-in returning `nnx.state(model)` (names `model.`) while the real
worker returns `{"base": state["model"]}` (names `base.`), which the sync refused with a ConversionPlanError.
"""

# vllm and tpu_inference exist only in .venv-tpu.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import inspect

import forward


def test_every_method_the_stand_in_has_is_vllm_llms_with_the_same_parameters():
  import vllm

  own = {n: f for n, f in vars(forward.ShimLLM).items() if inspect.isfunction(f) and not n.startswith("_")}
  assert own, "ShimLLM defines no method"
  for name, fn in own.items():
    real = getattr(vllm.LLM, name, None)
    assert real is not None, f"vllm.LLM has no {name}"
    assert list(inspect.signature(fn).parameters) == list(inspect.signature(real).parameters), name


def test_the_worker_is_tpu_inferences_own_and_its_weight_state_is_the_librarys():
  """The sync's worker methods are not overridden: `get_weights_state` is TPUWorker's, which calls
  `raiden_worker_sync.extract_weight_state` on the runner's split state (a MaxText model comes back under `base`)."""
  from flax import nnx
  from tpu_inference.rl import raiden_worker_sync
  from tpu_inference.worker.tpu_worker import TPUWorker

  class MaxTextForCausalLM(nnx.Module):  # the class name is what tpu-inference keys a MaxText model on

    def __init__(self):
      self.model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

  model = MaxTextForCausalLM()
  worker = forward.real_worker(model)
  assert worker.__class__ is TPUWorker  # not a subclass that could override a method
  for method in ("get_weights_state", "refresh_model_state_leaves", "start_weight_update", "finish_weight_update"):
    assert method not in vars(worker), method
  state = worker.get_weights_state()
  assert set(state) == {"base"} and raiden_worker_sync.is_maxtext_model(model)
  state["base"]["kernel"].set_value(state["base"]["kernel"].get_value() * 0 + 7)
  assert float(model.model.kernel.get_value().sum()) == 7 * 6  # the worker's leaves alias the model's
  shim = forward.ShimLLM.__new__(forward.ShimLLM)
  shim.llm_engine = type("E", (), {"model_executor": type("X", (), {"driver_worker": worker})})()
  shim.collective_rpc("start_weight_update", kwargs={"free_kv_cache": True})
  shim.collective_rpc("finish_weight_update")
  assert worker.model_runner.kv_cache_events == ["delete", "reinitialize"]
