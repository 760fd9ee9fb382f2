"""The per-host weight sync of a multi-controller run (maxtext_rl_plugin/resharding/per_host.py) on two real JAX
processes with 4 CPU devices each (gloo collectives): the trainer's global arrays reach every host's own engine mesh
bit for bit, sharded within the host as the engine asks, and the guard catches a host holding the wrong weights,
naming the host and the parameter on every process."""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

import _per_host_worker as worker
import _two_processes as two_processes


def _run_two(tmp_path) -> list[dict]:
  """tests/_per_host_worker.py as a 2-process JAX program (4 CPU devices each); what each process saw."""
  return two_processes.run(tmp_path, "_per_host_worker.py", devices_per_process=4)


def _bits(a: np.ndarray) -> list:
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).tolist()


@pytest.mark.solo
def test_per_host_sync_lands_the_global_weights_on_every_host_and_the_guard_names_the_bad_host(tmp_path):
  outs = _run_two(tmp_path)
  host = worker.host_arrays()
  assert host["wo"].dtype == ml_dtypes.bfloat16  # a 2-byte dtype compares bit for bit too
  for p, o in enumerate(outs):
    assert o["process"] == p
    for layout, n_engine in (("colocated", 4), ("disaggregated", 2)):
      engine_ids = o["local_ids"][-n_engine:]
      for name, got in o[layout].items():
        assert got["global_source"] and got["local"] and got["sharding_ok"], (layout, name)
        assert got["bits"] == _bits(host[name]), (p, layout, name)  # the global source, bit for bit
        # Within the host: one shard per engine device, split over "model" as the engine spec asks (or whole).
        assert [d for d, _ in got["shards"]] == engine_ids
        split = worker.SPECS[name][1]
        for _, shape in got["shards"]:
          want = [
              n // n_engine if axis == "model" else n for n, axis in zip(host[name].shape, (*split, None, None, None))
          ]
          assert shape == want, (layout, name, shape)
    assert o["clean"] is None and o["second_sync_clean"] is None and o["disaggregated_clean"] is None
    # Every process raises the same line, naming the host and the parameter.
    assert o["other_host_rows"].startswith("weight sync check failed on host 1 (JAX process 1): its engine's 'embed'")
    assert o["rotated_shards"].startswith("weight sync check failed on host 1 (JAX process 1): its engine's 'embed'")
    assert "3 of 4 parameters there" in o["rotated_shards"]  # every sharded one; the replicated norm is intact
    assert o["stale"].startswith("weight sync check failed on host 0 (JAX process 0): its engine's 'embed'")
    assert "4 of 4 parameters there; 1 of 2 hosts differ" in o["stale"]
  assert outs[0]["local_ids"] != outs[1]["local_ids"]  # two hosts' own devices
