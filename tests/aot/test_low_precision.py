"""aot/low_precision.py: the analytic roofline's bf16 column equals what the compiler reported for the same recipe
(docs/aot.md, the vLLM rollout of Llama 3.1 70B on v5p-128 at TP 8), and the quantized columns follow by hand; the
compiled table reads compile_rl's reports (tests/tpu_contract/test_aot_vllm.py compiles a quantized one)."""

import json

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


def _report(tokens, weights_gib, rollout_s, by_dtype=None):
  """The fields of compile_rl's JSON report (aot/run.py, aot/vllm_programs.py) the compiled table reads."""
  return {
      "vllm_rollout": {
          "weights_gib_per_device": weights_gib,
          "weights_gib_per_device_by_dtype": by_dtype or {"bfloat16": weights_gib},
          "kv_pool_gib_per_device": 60.0,
          "tokens_in_pool": tokens,
      },
      "programs": [
          {"name": "vllm_prefill_step", "gflops": 1.0, "gbytes": 1.0, "ms_per_call": 1.0},
          {"name": "vllm_decode_step", "gflops": 319.1, "gbytes": 12.88, "ms_per_call": 4.66},
      ],
      "step_seconds": {"rollout": rollout_s},
  }


def test_the_compiled_table_reads_the_reports_and_names_a_format_that_did_not_compile(tmp_path):
  recipe = lp.RECIPES["v5p-128"]
  fp8 = _report(1_571_072, 8.46, 3.65, {"float8_e4m3fn": 7.97, "bfloat16": 0.49})
  c = lp.compiled_figures(fp8, recipe)
  assert c["requests"] == 1_534  # 1,571,072 tokens / 1,024 per request, rounded down
  assert c["rl_step_s"] == pytest.approx(3.65 + 0.06)  # the rollout + the recipe's trainer programs
  assert c["quantized_gib"] == 7.97 and c["decode_ms"] == 4.66 and c["decode_gb"] == 12.88

  for fmt, rep, run in (
      ("fp8", fp8, {"returncode": 0, "wall_s": 77.0, "peak_rss_gb": 4.8, "error": None}),
      ("int8", None, {"returncode": 2, "wall_s": 9.0, "peak_rss_gb": 1.0, "error": "error: int8 refused here"}),
  ):
    report, record, _ = lp.paths(str(tmp_path), recipe, fmt)
    if rep:
      (tmp_path / report).write_text(json.dumps(rep))
    (tmp_path / record).write_text(json.dumps(run))
  rows = lp.table(str(tmp_path), {"v5p-128": recipe}, ("fp8", "int8", "bf16")).splitlines()[2:]
  assert rows[0].startswith("| v5p-128 TP 8 | fp8 | 8.46 (8.46) | 7.97 | 60.00 | 1.57 | 1,534 | 319 | 12.88 | 4.66 (")
  assert rows[0].endswith("| 3.65 | 3.71 | 77 / 4.8 |")
  assert rows[1].startswith("| v5p-128 TP 8 | int8 | not compiled: error: int8 refused here |")
  assert rows[2].startswith("| v5p-128 TP 8 | bf16 | not compiled: no report |")
  assert all(r.count("|") == rows[0].count("|") for r in rows)


def test_the_compile_asks_compile_rl_for_the_recipes_rollout_in_each_format():
  argv = lp.compile_argv(lp.RECIPES["tpu7x-128"], "fp8", "/tmp/x")
  assert "rollout_quantization=fp8" in argv and "compile_topology=tpu7x-128" in argv and "batch_size=16" in argv
  assert "rollout_quantization=" in lp.compile_argv(lp.RECIPES["tpu7x-128"], "bf16", "/tmp/x")
