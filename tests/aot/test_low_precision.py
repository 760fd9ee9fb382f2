"""aot/low_precision.py: the analytic roofline's bf16 column equals what the compiler reported for the same recipe
(docs/aot.md, the vLLM rollout of Llama 3.1 70B on v5p-128 at TP 8), and the quantized columns follow by hand."""

import pytest

from maxtext_rl_plugin.aot import low_precision as lp


def test_bf16_column_is_the_compiled_report():
  m = lp.Model()
  assert m.quantized_params + m.float_params == pytest.approx(70.55e9, rel=1e-3)  # "70.6e9 bf16 parameters"
  f = lp.figures(lp.RECIPES["v5p-128"], "bf16")
  assert f["weights_gib"] == pytest.approx(16.43, abs=0.01)  # "weights (131.4 / 8) 16.43 GiB"
  assert f["kv_pool_gib"] == pytest.approx(51.97, abs=0.01)  # "KV pool (0.72 x 95 - 16.43) 51.97 GiB"
  assert f["kv_tokens"] == pytest.approx(1.36e6, rel=0.01)  # "1.36 M tokens per replica"
  assert f["calibrated_decode_ms"] == pytest.approx(8.9, abs=0.05)  # vllm_decode_step 8.9 ms/call
  assert f["calibrated_rl_step_s"] == pytest.approx(6.94, rel=0.02)  # the step's roofline 6.94 s


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantized_weights_halve_the_bytes_and_free_them_for_the_kv_pool(fmt):
  m = lp.Model()
  by_hand = (m.quantized_params * 1 + m.scales * 4 + m.float_params * 2) / 8 / 2**30
  bf16, q = lp.figures(lp.RECIPES["v5p-128"], "bf16"), lp.figures(lp.RECIPES["v5p-128"], fmt)
  assert q["weights_gib"] == pytest.approx(by_hand)
  assert q["kv_pool_gib"] - bf16["kv_pool_gib"] == pytest.approx(bf16["weights_gib"] - q["weights_gib"])
  assert 0.5 < q["decode_ms"] / bf16["decode_ms"] < 0.55  # bandwidth-bound: the step follows the bytes
