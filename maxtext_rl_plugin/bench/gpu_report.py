"""`bench gpu`'s human report: the markdown table of everything measured (the JSON holds more), and its files."""

from __future__ import annotations

import os

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.bench import gpu_common


def _fmt(v, pct=False):
  if v is None:
    return "-"
  if pct:
    return f"{100 * v:.1f}%"
  return f"{v:,.1f}" if isinstance(v, float) else str(v)


def markdown(res: dict) -> str:
  """The human table of everything measured (the JSON holds more)."""
  info = res.get("device") or {}
  lines = [f"# bench gpu: {info.get('device')} ({info.get('backend')}, jax {info.get('jax')}), {res.get('date')}", ""]
  r = res.get("rollout", {})
  if "models" in r:
    ref = r["references"]
    lines += [
        f"bf16 matmul peak {ref['peak_flops'] / 1e12:.1f} TFLOP/s; device copy {ref['copy_bytes_per_s'] / 1e12:.2f} "
        "TB/s (read + write)",
        "",
        "| model | batch | tok/s | decode step ms | decode / roofline | prefill / peak | HF static tok/s | HF compiled "
        "tok/s | x best HF | greedy rows equal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in r["models"]:
      for b in m["by_batch"]:
        hf = [b.get("hf_static_tokens_per_s"), b.get("hf_static_compiled_tokens_per_s")]
        best = max((x for x in hf if x), default=None)
        eq = (b.get("hf_static_greedy") or {}).get("rows_identical")
        lines.append(
            f"| {m['model']} | {b['batch']} | {_fmt(b['tokens_per_s'])} | {_fmt(b['decode_step_ms'])} | "
            f"{_fmt(b['decode_fraction_of_roofline'], True)} | {_fmt(b['prefill_fraction_of_peak'], True)} | "
            f"{_fmt(hf[0])} | {_fmt(hf[1])} | {_fmt(best and round(b['tokens_per_s'] / best, 2))} | {_fmt(eq, True)} |"
        )
    if r.get("peer_skipped"):
      lines.append(f"\nHF peer skipped: {r['peer_skipped']}")
    lines.append("")
  s = res.get("step", {})
  if "bench_step" in s:
    b = s["bench_step"]
    lines += [f"GRPO step, {b['model']}, {b['batch']}, {b['new_tokens']} new tokens (warm step, s)", ""]
    lines += ["| phase | plugin | Tunix |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v} | {b['tunix_s'][k]} |" for k, v in b["plugin_s"].items()]
    pd = s.get("peak_device_bytes")
    lines += [
        "",
        f"update MFU (bf16 peak): plugin {_fmt(s['update_mfu']['plugin'], True)}, Tunix "
        f"{_fmt(s['update_mfu']['tunix'], True)}; peak device memory "
        f"{'-' if pd is None else f'{pd / 2**30:.2f} GiB'}",
        "",
    ]
  y = res.get("sync", {})
  if "models" in y:
    lines += [
        "| weights | bytes | sync s | sync GB/s | copy GB/s | method |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for m in y["models"]:
      sec = m.get("reshard_s")
      bps = None if m.get("aliases_source") else m.get("reshard_bytes_per_s")  # zero-copy: no bandwidth to speak of
      lines.append(
          f"| {m['model']} | {m['bytes']:,} | {sec} | {_fmt(bps and bps / 1e9)} | "
          f"{_fmt(m.get('copy_bytes_per_s') and m['copy_bytes_per_s'] / 1e9)} | {m['method']}"
          f"{' (zero-copy: the sampler holds the source arrays)' if m.get('aliases_source') else ''} |"
      )
    lines.append("")
  d = res.get("demo", {})
  if "wall_s" in d and "returncode" in d:
    lines += [f"demo run: {d['wall_s']} s wall (exit {d['returncode']})", "", "```", d.get("summary_table") or "-", "```"]
  for part in gpu_common.PARTS:
    if "error" in res.get(part, {}):
      lines.append(f"\n{part}: {res[part]['error']}")
  return "\n".join(lines) + "\n"


def write(out_dir: str, res: dict) -> None:
  with open(os.path.join(out_dir, "gpu_bench.json"), "w", encoding="utf-8") as f:
    f.write(common.finite_json(res, indent=1))
  with open(os.path.join(out_dir, "gpu_bench.md"), "w", encoding="utf-8") as f:
    f.write(markdown(res))
