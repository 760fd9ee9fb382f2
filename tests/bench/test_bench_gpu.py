"""`bench gpu` cannot rot: its dry mode runs every part on CPU, and its figures are re-derived independently."""

import json

import numpy as np
import pytest

from maxtext_rl_plugin.bench import __main__ as bench_main
from maxtext_rl_plugin.bench import gpu_common
from maxtext_rl_plugin.bench import gpu_report
from maxtext_rl_plugin.bench import gpu_rollout


@pytest.mark.extended  # the GPU harness's dry run: run it before a device session
@pytest.mark.slow  # every part in its own process: minutes on 2 cores
def test_dry_run_measures_every_part_and_writes_json_and_markdown(tmp_path, capsys):
  """All four parts at tiny shapes, each in its own process; the files the device call brings back exist."""
  rc = bench_main.main(["gpu", "--dry", "--out", str(tmp_path)])
  final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  saved = json.loads((tmp_path / "gpu_bench.json").read_text())
  assert rc == 0, {p: saved[p].get("error") for p in gpu_common.PARTS}
  assert final["benchmark"] == "gpu" and final["device"]["backend"] == "cpu"
  for part in gpu_common.PARTS:
    assert "error" not in saved[part] and "partial" not in saved[part], (part, saved[part])

  roll = saved["rollout"]
  rows = roll["models"][0]["by_batch"]
  assert [r["batch"] for r in rows] == [1, 2]
  weights = roll["models"][0]["read_weight_bytes"]
  # cpu_tiny's Qwen3 (emb 64, 4 q / 2 kv heads of 16, mlp 128, 2 layers) with a 528-row tied table, in bf16: per layer
  # q, k, v, o kernels, q/k norms, two layer norms and the 3 MLP kernels; then the table and the final norm.
  layer = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2 + 16 * 2 + 64 * 2 + 3 * 64 * 128
  assert weights == 2 * (2 * layer + 528 * 64 + 64)
  kv_per_position = 2 * 2 * 2 * 16 * 2  # K and V x cpu_tiny's 2 layers x 2 KV heads x 16 dims x 2 bytes (bf16)
  for r in rows:
    # 8 prompt tokens + 4 new: the average step attends over 8 + 4 / 2 positions of each row.
    assert r["decode_bytes_per_step"] == weights + r["batch"] * 10 * kv_per_position
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * 4 / r["generate_s"], rel=1e-2)
    assert 0 < r["prefill_fraction_of_peak"] < 1 and r["prefill_s"] > 0
    # A 4-token decode of a tiny model is within timing noise of its prefill on a loaded host: no sign asserted.
    assert r["decode_fraction_of_roofline"] is None or r["decode_fraction_of_roofline"] > 0
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import  # only to know which branch ran
  except ImportError:
    assert "torch" in roll["peer_skipped"]

  step = saved["step"]["bench_step"]
  assert set(step["plugin_s"]) == {"rollout", "reward", "logps", "update", "sync", "overhead", "total"}
  mfu = saved["step"]["update_mfu"]["plugin"]
  assert mfu == pytest.approx(
      step["flops"]["plugin"]["update"] / step["plugin_s"]["update"] / saved["step"]["references"]["peak_flops"],
      rel=1e-2,
  )

  sync = saved["sync"]["models"][0]
  assert sync["bitwise_equal"] is True and sync["bytes"] == saved["rollout"]["models"][0]["read_weight_bytes"]

  demo = saved["demo"]
  assert demo["returncode"] == 0 and "eval accuracy" in demo["summary_table"]

  md = (tmp_path / "gpu_bench.md").read_text()
  assert "| tiny | 2 |" in md and "GRPO step" in md and "demo run:" in md


class _Cfg:
  num_decoder_layers, num_kv_heads, head_dim, dtype = 3, 2, 16, "bfloat16"


def test_decode_bytes_are_weights_plus_kv_of_the_real_context():
  # K and V, 3 layers x 2 heads x 16 dims, 2 bytes each, per position and row.
  per_pos = 2 * 3 * 2 * 16 * 2
  assert gpu_rollout.decode_bytes_per_step(_Cfg(), 1000, batch=4, context=10.5) == 1000 + 4 * 10.5 * per_pos


def test_hf_state_dict_computes_what_the_maxtext_kernels_compute():
  """HF Linear layout ([out, in], heads flattened) applied to x gives MaxText's einsums over its scanned kernels (the
  whole HF model on these weights against MaxText's logits: tests/tpu_contract/test_hf_peer.py, extended, .venv-tpu)."""
  # pylint: disable=import-outside-toplevel  # jax: after conftest's platform
  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import models

  rs = models.setup_devices(config_lib.parse(["configs/cpu_tiny.yml", *gpu_common.SHAPES["tiny"]]))
  model, _ = models.build_model(rs.trainer_config, rs.trainer_devices)
  cfg = rs.trainer_config
  sd = gpu_rollout.hf_state_dict(model, cfg)
  L = int(cfg.num_decoder_layers)
  assert len(sd) == 2 + 11 * L  # embedding, final norm; per layer 4 projections, 2 qk norms, 2 norms, 3 MLP
  base = model.base
  x = np.random.default_rng(0).standard_normal((3, int(cfg.emb_dim))).astype(np.float32)
  for i in (0, L - 1):
    sa = base.decoder.layers.self_attention
    q = np.einsum("be,ehd->bhd", x, np.asarray(sa.query.kernel.value[:, i], np.float32))
    np.testing.assert_allclose(
        x @ sd[f"model.layers.{i}.self_attn.q_proj.weight"].T, q.reshape(3, -1), rtol=1e-5, atol=1e-5
    )
    o_in = q  # [b, heads, head_dim] -> emb
    o = np.einsum("bhd,hde->be", o_in, np.asarray(sa.out.kernel.value[:, i], np.float32))
    np.testing.assert_allclose(
        o_in.reshape(3, -1) @ sd[f"model.layers.{i}.self_attn.o_proj.weight"].T, o, rtol=1e-4, atol=1e-4
    )
    wo = np.asarray(base.decoder.layers.mlp.wo.kernel.value[:, i], np.float32)  # [mlp, emb]
    h = np.random.default_rng(1).standard_normal((3, wo.shape[0])).astype(np.float32)
    np.testing.assert_allclose(h @ sd[f"model.layers.{i}.mlp.down_proj.weight"].T, h @ wo, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      sd["model.embed_tokens.weight"], np.asarray(base.token_embedder.embedding.value, np.float32)
  )


def test_markdown_reports_a_failed_part_and_an_empty_run():
  md = gpu_report.markdown({"date": "d", "rollout": {"error": "ImportError: no module named maxtext"}})
  assert "rollout: ImportError: no module named maxtext" in md
  assert gpu_report.markdown({}).startswith("# bench gpu")


def test_agreement_counts_identical_rows_and_first_mismatch():
  a = np.array([[1, 2, 3], [1, 2, 3]])
  b = np.array([[1, 2, 3], [1, 9, 3]])
  assert gpu_rollout.greedy_agreement(a, b) == {"rows_identical": 0.5, "mean_first_mismatch_step": 2.0}
