"""What `max_seq_token_per_tpu` buys: `python -m maxtext_rl_plugin.bench packing [--data FILE] [yml] [key=value ...]`.

Two measurements, side by side in one run:

* **Token slots at real lengths.** Every GSM8K row of `--data` (the train split's JSONL) becomes the sequence a run
  trains on: the prompt as the run builds it (the config's tokenizer, chat template and system prompt) and the
  reference solution as the completion (a stand-in for a sampled one: the same format, the length of a correct
  answer). Batches of `--rows` sequences are laid out padded (one row of max_target_length each, the run's default) and
  packed (first-fit decreasing into rows of `max_seq_token_per_tpu`, algorithms/packing.py). Reported: the share of
  slots holding a token, the rows, and the forward FLOPs per token of the layers (linear in the slots) and of
  attention (each row's full L x L score matrix: the dot-product kernel computes masked positions too).
* **The update on CPU.** The loss and gradient of the plugin's policy loss on the first `--update-rows` of those
  sequences at the same widths, padded against packed, on cpu_tiny's MaxText model (the demo's small vocabulary);
  the median of `--repeats` timed calls after a compile.
"""

# jax, and everything that imports it, is imported inside the functions (bench/step.py's convention).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from maxtext_rl_plugin.bench import common

# MaxText's post_train/rl.yml widths (256 prompt + 768 completion tokens) with the Qwen3 tokenizer and chat template.
DEFAULT_ARGV = ["configs/cpu_tiny.yml", "max_prefill_predict_length=256", "max_target_length=1024"]


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench packing", description=__doc__.splitlines()[0])
  p.add_argument("--data", default="../shared/data/gsm8k/train.jsonl", help="GSM8K-style JSONL (question, answer)")
  p.add_argument(
      "--rows", type=common.positive_int, default=64, help="sequences per update batch (8 prompts x 8 samples)"
  )
  p.add_argument(
      "--row-tokens", type=common.non_negative_int, default=0, help="max_seq_token_per_tpu (0: max_target_length)"
  )
  p.add_argument("--update-rows", type=common.positive_int, default=16, help="sequences in the timed update's batch")
  p.add_argument("--repeats", type=common.positive_int, default=5, help="timed update calls per layout")
  p.add_argument("argv", nargs="*", help="yml and key=value overrides (default: cpu_tiny at MaxText's RL lengths)")
  return p.parse_args(argv)


def lengths(config, path: str) -> tuple[np.ndarray, np.ndarray]:
  """(prompt tokens, completion tokens) of every row of `path` as a run of `config` would lay them out."""
  from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
  from maxtext_rl_plugin.data import prompts

  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  settings = prompts.PromptSettings.from_config(config)
  texts = [prompts.build_prompt(r["question"], tok, settings) for r in rows]
  p = np.array(prompts.prompt_lengths(tok, texts))
  c = np.array([len(tok.encode(r["answer"], add_special_tokens=False)) + 1 for r in rows])  # + the stop token
  budget_p = int(config.max_prefill_predict_length)
  budget_c = int(config.max_target_length) - budget_p
  return np.minimum(p, budget_p), np.minimum(c, budget_c)


def slots(p_len: np.ndarray, c_len: np.ndarray, rows: int, row_tokens: int, width: int) -> dict:
  """Padded against packed layouts of consecutive batches of `rows` sequences."""
  from maxtext_rl_plugin.algorithms import packing

  real = padded_rows = packed_rows = 0
  attn_padded = attn_packed = 0.0
  for s in range(0, len(p_len) - rows + 1, rows):
    n = p_len[s : s + rows] + c_len[s : s + rows]
    _, _, r = packing.first_fit_decreasing(n, row_tokens)
    real += int(n.sum())
    padded_rows += rows
    packed_rows += r
    attn_padded += rows * width**2
    attn_packed += r * row_tokens**2
  return {
      "sequences": padded_rows,
      "tokens_per_sequence": real / padded_rows,
      "padded_fill": real / (padded_rows * width),
      "packed_fill": real / (packed_rows * row_tokens),
      "rows_padded_per_batch": rows,
      "rows_packed_per_batch": packed_rows / (padded_rows / rows),
      "layer_flops_packed_over_padded": (packed_rows * row_tokens) / (padded_rows * width),
      "attention_flops_packed_over_padded": attn_packed / attn_padded,
  }


def time_update(config, p_len: np.ndarray, c_len: np.ndarray, rows: int, repeats: int) -> dict:
  """Median seconds of the policy loss's value and gradient on one batch, padded and packed (same weights, same
  batch); the loss values agree to float32 round-off (printed)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tunix.rl.grpo import grpo_learner

  from maxtext_rl_plugin.algorithms import packing
  from maxtext_rl_plugin.aot import programs
  from maxtext_rl_plugin.run import models

  rs = models.setup_devices(_parsed(config))
  cfg = rs.trainer_config
  model, mesh = models.build_model(cfg, rs.trainer_devices, pad_id=programs.PAD_ID)
  loss_fn, algo = programs.loss_fn_of(cfg)
  width_p = int(cfg.max_prefill_predict_length)
  width_c = int(cfg.max_target_length) - width_p
  rng = np.random.default_rng(0)
  pl, cl = np.minimum(p_len[:rows], width_p), np.minimum(c_len[:rows], width_c)
  prompt = np.where(np.arange(width_p)[None] >= (width_p - pl)[:, None], rng.integers(2, 500, (rows, width_p)), 0)
  completion = np.where(np.arange(width_c)[None] < cl[:, None], rng.integers(2, 500, (rows, width_c)), 0)
  example = grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(prompt, jnp.int32),
      prompt_mask=jnp.asarray(prompt != 0, jnp.int32),
      completion_ids=jnp.asarray(completion, jnp.int32),
      completion_mask=jnp.asarray(completion != 0, jnp.int32),
      advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
      ref_per_token_logps=None,
      old_per_token_logps=None,
  )
  row_tokens = int(cfg.max_target_length)
  packed = packing.pack_example(example, programs.PAD_ID, row_tokens, steps=1, put=jnp.asarray)

  @nnx.jit
  def step(m, ex):
    return nnx.value_and_grad(lambda m: loss_fn(m, ex, algo)[0])(m)

  out = {}
  with jax.set_mesh(mesh):
    for name, ex in (("padded", example), ("packed", packed)):
      loss, grads = step(model, ex)  # compile
      jax.block_until_ready(grads)
      times = []
      for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(model, ex))
        times.append(time.perf_counter() - t)
      out[f"update_s_{name}"] = statistics.median(times)
      out[f"loss_{name}"] = float(loss)
  out["update_packed_over_padded"] = out["update_s_packed"] / out["update_s_padded"]
  out["rows_packed"] = int(packed.packed_tokens.shape[0])
  out["row_tokens"] = row_tokens
  return out


def _parsed(config):
  from maxtext_rl_plugin.config import load as config_lib

  return config_lib.parse(config)


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  from maxtext_rl_plugin.config import load as config_lib

  argv_cfg = args.argv or DEFAULT_ARGV
  config = config_lib.load_config(argv_cfg)
  row_tokens = args.row_tokens or int(config.max_target_length)
  p_len, c_len = lengths(config, args.data)
  result = {"lengths": slots(p_len, c_len, args.rows, row_tokens, int(config.max_target_length))}
  result["lengths"].update(row_tokens=row_tokens, width=int(config.max_target_length))
  # The update on cpu_tiny at the same widths and lengths; the demo's 528-token vocabulary keeps its logits in memory
  # (token ids are random: the time does not depend on them).
  tiny = [
      "configs/cpu_tiny.yml",
      "tokenizer_path=tokenizers/arith-bpe-512",
      "vocab_size=528",
      "use_chat_template=false",
      "data_template_path=cpu_demo_template.json",
      "rl.grpo_beta=0",  # the policy's forward and backward: the reference forward is timed by neither
      f"max_prefill_predict_length={int(config.max_prefill_predict_length)}",
      f"max_target_length={int(config.max_target_length)}",
  ]
  result["update"] = time_update(tiny, p_len, c_len, args.update_rows, args.repeats)
  print(common.finite_json(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
