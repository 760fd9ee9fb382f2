"""train_rl as one multi-process JAX program (multi-controller: Ray workers, multi-host TPU without Pathways).

* `maxtext_rl_plugin.distributed` on two plain processes (gloo CPU collectives): global arrays built from the same host
  data on every process hold exactly that data, reductions across processes are right, typed PRNG keys move memory
  kinds, and processes that disagree on a value fail loudly.
* The `launch ray --num-workers 2` job end to end is in tests/launch/test_ray_train.py and
  tests/launch/test_ray_disaggregated.py
  (their own files, so pytest-xdist runs the two Ray jobs beside the rest).
"""

from __future__ import annotations

import types

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest
from tunix.rl import utils as rl_utils
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.run import engine as run_engine

import _two_processes as two_processes


def _two_processes(tmp_path, mode: str, devices_per_process: int = 1) -> list[dict]:
  """Run tests/_multiprocess_worker.py in `mode` as a 2-process JAX program; what each process saw."""
  return two_processes.run(tmp_path, "_multiprocess_worker.py", mode, devices_per_process=devices_per_process)


@pytest.mark.solo
def test_distributed_helpers_on_two_processes(tmp_path):
  outs = _two_processes(tmp_path, "helpers")
  host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5
  for i, o in enumerate(outs):
    assert o["process"] == i and not o["fully_addressable"]
    # Each process holds its own half of the rows (sharded, not replicated), bit for bit the source rows.
    np.testing.assert_array_equal(np.asarray(o["local_rows"][0], np.float32), host[2 * i : 2 * i + 2])
    np.testing.assert_array_equal(np.asarray(o["to_host"], np.float32), host)
    np.testing.assert_allclose(o["row_sums"], host.sum(axis=1), rtol=1e-6)
    assert o["total"] == pytest.approx(float(host.sum()), rel=1e-6)
    assert o["odd_rows_replicated"] is True  # 3 rows over 2 processes: replicated, never a ragged shard
    assert o["key_memory_kind"] == "pinned_host"
    np.testing.assert_array_equal(o["w_back"], host)
    assert o["restore_sharding_replicated"] is True and o["agree"] == 5 and o["from_writer"] == 100
    assert o["disagree"].startswith("CheckpointError: processes disagree on the process index: [0, 1]")
  assert outs[0]["key_data"] == outs[1]["key_data"]
  np.testing.assert_array_equal(
      outs[0]["key_data"], np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), 2)))
  )


@pytest.mark.solo
def test_disaggregated_split_weight_sync_and_rollout_slices_on_two_processes(tmp_path):
  """2 processes x 2 devices: the trainer mesh spans each process's first device, each process samples on a mesh of
  its own second device. The weight sync lands the trainer's arrays on every process's sampler bit for bit (under
  Tunix's transfer guards, checked by the sync's own guard, which also catches a corrupted copy); each process
  samples its own half of the prompt groups and every process then holds the whole batch, also on the trainer mesh."""
  outs = _two_processes(tmp_path, "split", devices_per_process=2)
  host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5
  keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 2)))
  texts = [f"p{i // 2}-row{i}-é" * (i + 1) for i in range(4)]
  for i, o in enumerate(outs):
    assert [p for p, _ in o["trainer"]] == [0, 1]  # one trainer device per process: a global mesh
    assert [p for p, _ in o["sampler"]] == [i] and o["sampler"][0] not in o["trainer"]  # a per-host sampler mesh
    assert o["w_global"] and o["held_local"] and set(o["held_devices"]) == {o["sampler"][0][1]}
    np.testing.assert_array_equal(np.asarray(o["w"], np.float32), host)
    np.testing.assert_array_equal(np.asarray(o["b"], np.float32), host[0] * -3.0)
    np.testing.assert_array_equal(np.asarray(o["k"], np.uint32), keys)
    assert o["num_verified"] == 1 and o["corrupt_caught"]
    assert o["own"] == [2 * i, 2 * i + 2]
    np.testing.assert_array_equal(np.asarray(o["rows"], np.float32), host * 2.0)
    np.testing.assert_array_equal(np.asarray(o["on_trainer"], np.float32), host * 2.0)
    assert o["texts"] == texts


def test_one_process_helpers_equal_jax_and_tunix():
  """On one process the helpers are what they replace: device_put for placement, Tunix's memory-kind move."""
  mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
  host = np.arange(6, dtype=np.float32).reshape(2, 3)
  x = distributed.global_batch(host, mesh)
  ref = jax.device_put(host, NamedSharding(mesh, P("fsdp", None)))
  assert x.sharding == ref.sharding
  np.testing.assert_array_equal(distributed.to_host(x), np.asarray(ref))
  tree = {"w": ref, "b": jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, P()))}
  ours, theirs = distributed.put_on_memory_kind(tree, "pinned_host"), rl_utils.put_params_on_memory_kind(
      tree, "pinned_host"
  )
  for k in tree:
    assert ours[k].sharding == theirs[k].sharding and ours[k].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]))
  assert distributed.restore_sharding(x, mesh) == x.sharding  # one process: shardings restore as they are
  assert distributed.agree(3, "x") == 3 and distributed.agree_from_writer(4) == 4


def test_split_local_devices_gives_every_process_trainer_and_its_own_sampler_devices():
  devs = [types.SimpleNamespace(process_index=p, id=10 * p + i) for p in (0, 1) for i in range(4)]
  trainer, sampler = distributed.split_local_devices(devs, 0.5, 0.5)
  assert [d.id for d in trainer] == [0, 1, 10, 11]  # one global trainer mesh: the first half of every process
  assert [d.id for d in sampler] == [2, 3]  # this process's (0) own last devices: a per-host sampler mesh
  trainer, sampler = distributed.split_local_devices(devs, 0.75, 0.25)
  assert [d.id for d in trainer] == [0, 1, 2, 10, 11, 12] and [d.id for d in sampler] == [3]
  with pytest.raises(distributed.ConfigError, match="must split into >= 1 trainer and >= 1 sampler"):
    distributed.split_local_devices(devs, 0.75, 0.5)  # 3 + 2 > 4 devices per process
  assert distributed.process_slice(4) == slice(0, 4)  # one process samples every prompt


def test_per_row_sampling_keys_do_not_depend_on_how_the_batch_is_split():
  """The embedded engine's `prompt_offset` mode (a per-host sampler: each process samples its own prompts): a row's
  tokens depend only on the call's key, its prompt's global index and its generation index, so sampling prompts 2-3
  on their own (offset 2, a smaller bucket) gives exactly the rows of one call over prompts 0-3."""
  rs = models.setup_devices(config_lib.parse(["configs/cpu_tiny.yml"]))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(model.base.config, mesh)
  )
  texts = ["Tom has 3 apples.", "What is 12 * 7?", "Hi", "Name a prime number larger than ten."]
  g = 3
  rc = base_rollout.RolloutConfig(max_tokens_to_generate=8, temperature=30.0, seed=11, max_prompt_length=32)

  def rows(prompts, offset):
    engine.prompt_offset = offset
    out = engine.generate([t for t in prompts for _ in range(g)], rc)
    return [c.tolist() for c in out.tokens], out.logprobs

  whole, whole_lp = rows(texts, 0)
  first, _ = rows(texts[:2], 0)
  second, second_lp = rows(texts[2:], 2)
  assert first + second == whole
  for a, b in zip(second_lp, whole_lp[2 * g :]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # float32 logits of a 4-row vs an 8-row batch
  assert len({tuple(r) for r in whole}) > len(texts)  # generations of a prompt differ: the keys are per row
  shifted, _ = rows(texts[2:], 0)
  assert shifted != second  # the global prompt index is part of the key
  engine.prompt_offset = None
