"""GSM8K-style problems for RL: the HF hub, local JSONL/Parquet files, or built-in synthetic arithmetic.

Sources (per split, first that applies):
* `train_data_path=` / `eval_data_path=`: local JSONL, JSON or Parquet file(s) (comma-separated, globs ok)
  with GSM8K's columns `question` and `answer` ("... #### N");
* `dataset_name=synthetic` / `eval_dataset_name=synthetic`: seeded arithmetic word problems with exact
  integer answers and worked solutions (the CPU demo's data; no download);
* otherwise `datasets.load_dataset(dataset_name, hf_subset, split=train_split|eval_split)` (openai/gsm8k).

One concern a module: `rows.py` reads files and the hub and decodes rows (gold answers parsed once, `#### 1,200` ->
"1200"; malformed rows skipped and counted in one warning per source); `synthetic.py` is the synthetic task;
`prompts.py` templates a question into the model's prompt; `splits.py` holds the random-access splits and their
batching (batch k is a pure function of (seed, k), so a resumed run continues at its data position with no repeated
or skipped batch); `load.py` picks each split's source and drops prompts longer than `max_prefill_predict_length`
(MaxText does the same filtering, silently).
"""
