"""The CPU demo's tokenizer: a 512-token byte-level BPE trained on the synthetic arithmetic generator.

Why the demo does not use the Qwen3 tokenizer: with a 151,936-entry vocabulary the output projection is
~97% of a tiny model's FLOPs, so a 2-core CPU manages only a handful of RL steps in 15 minutes. A byte-level
BPE over the generator's own text keeps every string representable (bytes are the base alphabet, decoding is
exact, so rewards see exactly what the model wrote), splits numbers into single digits (what a small model
needs to learn arithmetic), and makes the logits 300x narrower. Everything else in the demo is unchanged:
it is loaded with `transformers.AutoTokenizer` like any Hugging Face tokenizer.

Regenerate with `python -m maxtext_rl_plugin.demo_tokenizer configs/tokenizers/arith-bpe-512` (deterministic).
"""

from __future__ import annotations

import json
import os
import random
import sys

from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import Tokenizer
from tokenizers import trainers

from maxtext_rl_plugin.data import synthetic

SPECIALS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
TAGS = ["<reasoning>", "</reasoning>", "<answer>", "</answer>"]
# The calculator's tool-call markup (synthetic_task=products, rl.use_agentic_rollout) as whole tokens, added after the
# tags so every earlier id is unchanged: a call is ~11 tokens instead of ~80 byte-level ones.
TOOL_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name": "calculator", "arguments": {"a": ',
    ', "b": ',
    ', "op": "*"}}',
]
VOCAB_SIZE = 512


def corpus(n: int = 20000, seed: int = 0):
  """Prompts and solutions from the synthetic generator over every difficulty the knobs allow."""
  rng = random.Random(seed)
  for i in range(n):
    cfg = synthetic.SyntheticSettings(seed=seed, min_steps=1, max_steps=1 + i % 4, max_value=(10, 20, 50, 100)[i % 4])
    question, answer, solution = synthetic.synthetic_problem(rng, cfg)
    body = "\n".join(solution.splitlines()[:-1])
    yield f"Question: {question}\nAnswer with <reasoning>...</reasoning><answer>N</answer>.\n"
    yield f"<reasoning>{body}</reasoning>\n<answer>{answer}</answer>"
  yield "0123456789 +-*/=$.,:;!?()'\"#%&"


def build(out_dir: str) -> str:
  """Train the demo's BPE tokenizer on `corpus()` and save it under `out_dir`; returns the tokenizer.json path."""
  tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(r"<[/]?(reasoning|answer)>"), behavior="isolated"),
          pre_tokenizers.Digits(individual_digits=True),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
      ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE,
      special_tokens=list(SPECIALS.values()),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(corpus(), trainer=trainer)
  tok.add_tokens(TAGS + TOOL_TOKENS)  # whole-tag tokens (not special: they must survive decoding)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": False,
            **SPECIALS,
        },
        f,
        indent=2,
    )
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
    json.dump(SPECIALS, f, indent=2)
  return out_dir


if __name__ == "__main__":
  print(build(sys.argv[1] if len(sys.argv) > 1 else os.path.join("configs", "tokenizers", "arith-bpe-512")))
