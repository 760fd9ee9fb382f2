"""Overrides that put an end-to-end test's cpu_tiny run on the CPU demo's 528-token tokenizer.

With Qwen3's 151,936-token vocabulary the output layer is most of cpu_tiny's work (its logits are 2,400x wider than
the model); a 2-step run costs ~8 CPU-s more with it (docs/DEVELOPMENT.md, "Two tiers"). Tests whose promise is about
the run (checkpoints, resumes, signals, updates, evaluation) use this; the Qwen3 tokenizer and its chat template keep
their own tests (tests/data/test_data.py, tests/test_install.py, tests/test_train_e2e.py's GSM8K run, ...).
"""

SMALL_VOCAB = (
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
)
