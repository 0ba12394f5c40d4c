"""Reference for `accrue bench data`: Hugging Face `datasets.map(batched=True,
num_proc=2)` tokenizing a JSONL file with the same tokenizer and chat
template accrue uses (rows with `messages` go through the tokenizer's chat
template, `prompt`/`response` rows are prompt + response + EOS, as accrue's
SFT rows). Prints one JSON object: rows, seconds, rows_per_s.

Usage: bench_tokenize.py TOKENIZER_DIR FILE.jsonl [--num-proc 2]
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_datasets  # noqa: E402

ensure_datasets()

import datasets  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_dir")
    ap.add_argument("file")
    ap.add_argument("--num-proc", type=int, default=2)
    a = ap.parse_args()
    datasets.disable_progress_bars()
    tok = PreTrainedTokenizerFast.from_pretrained(a.tokenizer_dir)
    eos = tok.eos_token or ""

    def encode(batch):
        texts = []
        if "messages" in batch:
            for m in batch["messages"]:
                texts.append(tok.apply_chat_template(m, tokenize=False))
        else:
            for p, r in zip(batch["prompt"], batch["response"]):
                texts.append(p + r + eos)
        enc = tok(texts, add_special_tokens=False)
        return {"input_ids": enc["input_ids"]}

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        ds = datasets.load_dataset("json", data_files=a.file, split="train", cache_dir=cache)
        out = ds.map(
            encode,
            batched=True,
            num_proc=a.num_proc,
            remove_columns=ds.column_names,
            load_from_cache_file=False,
        )
        rows = len(out)
        secs = time.perf_counter() - t0
    print(json.dumps({"impl": "datasets.map", "rows": rows, "seconds": secs, "rows_per_s": rows / secs}))


if __name__ == "__main__":
    main()
