"""The parity gate at a quantized sampler's defaults (`rollout_quantization`, run/parity.py): the demo model's measured
log-probs replayed through the gate. An honest int8 / FP8 sampler passes at every measured stage; deliberately wrong
scales stop it: FP8 scales read as e4m3fnuz's (every weight x1.87), one tensor's scales in reversed channel order.

The log-probs are the gate's inputs of step 1 of the CPU demo after 30 and 300 SFT warm-start steps, the hardest of 3
seeds per case (honest: the largest figures; a wrong scale: the smallest), written by
`scripts/parity_floor.py --out OUT --warm W --seeds 0 1 2 --mutations honest int8 fp8 fp8_fnuz fp8_rev_out_L1
int8_rev_out_L1` then `--export tests/data/parity_quantized_warmW.npz --export-set quantized` (float32 and
bfloat16 compute). The figures are checked against NumPy. Cheap: no model is built.
"""

import os
import types

import numpy as np
import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import parity

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
STAGES = (30, 300)
# case -> stops at the defaults (None: not asserted at that compute precision)
CASES = {
    "float32/int8": False,
    "float32/fp8": False,
    "float32/fp8_fnuz": True,
    "float32/fp8_rev_out_L1": True,
    "float32/int8_rev_out_L1": True,
    "bfloat16/int8": False,
    "bfloat16/fp8": False,
}


def _config(dtype, q):
  """The keys the gate reads (test_pairing_follows_the_matmuls_precision loads the real config once)."""
  rl = types.SimpleNamespace(
      parity_logp_tolerance_mean=None, parity_logp_tolerance_max=None, parity_routing_tolerance=None
  )
  return types.SimpleNamespace(
      dtype=dtype, weight_dtype="float32", matmul_precision="default", rollout_quantization=q, rl=rl
  )


@pytest.fixture(name="tolerances", scope="module")
def tolerances_fixture():
  out = {}
  for dtype in ("float32", "bfloat16"):
    for q in ("int8", "fp8"):
      assert parity.pairing(_config(dtype, q), backend="cpu") == f"{q}/{dtype}"
      out[(dtype, q)] = parity.tolerance(_config(dtype, q), backend="cpu")
  return out


@pytest.mark.parametrize("stage", STAGES)
def test_quantized_samplers_pass_and_wrong_scales_stop_at_the_defaults(tolerances, stage):
  path = os.path.join(DATA, f"parity_quantized_warm{stage}.npz")
  z = np.load(path)
  seen = 0
  for case, stops in CASES.items():
    if f"{case}/sampler" not in z:
      continue
    seen += 1
    dtype, name = case.split("/")
    s, t = z[f"{case}/sampler"], z[f"{case}/trainer"]
    d = np.abs(s.astype(np.float64) - t.astype(np.float64))
    assert d.size > 800
    figs = parity.figures(s[None], t[None], np.ones((1, s.size), bool))
    assert figs["parity/logp_abs_diff_mean"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
    assert figs["parity/logp_abs_diff_max"] == pytest.approx(d.max(), rel=1e-9, abs=1e-15)
    tol = tolerances[(dtype, "int8" if name.startswith("int8") else "fp8")]
    which = parity.exceeded(figs, tol)
    assert (which is not None) == stops, (stage, case, figs, tol, which)
    if stops:  # the one line names the figure and the pairing
      pair = f"{name.split('_')[0]}/{dtype}"
      with pytest.raises(parity.ParityError, match=f"sampler/trainer {pair}"):
        parity.check(1, figs, tol, pair)
  assert seen >= 5


def test_pairing_follows_the_matmuls_precision():
  cfg = config_lib.load_config(["configs/cpu_demo.yml", "rollout_quantization=fp8"])
  assert parity.pairing(cfg, backend="cpu") == "fp8/float32"
  assert parity.pairing(cfg, backend="tpu") == "fp8/bfloat16"  # float32 at the accelerator's default precision
  assert parity.tolerance(cfg, backend="tpu") == parity.PAIRING_TOLERANCES["fp8/bfloat16"]
