"""Loads a model folder written by `accrue export` the way a user would
(AutoModelForCausalLM + AutoTokenizer), and checks it against what Accrue
says it trained with.

usage: check_export.py DIR < expect.json
expect.json: {"texts": [str], "ids": [[int]] (the ids Accrue's tokenizer
gives each text, special tokens added), "messages": [{role, content}],
"rendered": str (Accrue's chat-template rendering of messages),
"prompt_ids": [int], "new_tokens": int}
prints one JSON line: {"encode_ok", "decode_ok", "template_ok", "dtype",
"generated", "bad": [str]}
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main():
    folder = sys.argv[1]
    want = json.load(sys.stdin)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    bad = []
    for text, ids in zip(want["texts"], want["ids"]):
        got = tok(text)["input_ids"]
        if got != ids:
            bad.append(f"encode {text!r}: {got} != {ids}")
        back = tok.decode(ids, skip_special_tokens=False)
        if back != tok.bos_token + text:
            bad.append(f"decode {ids}: {back!r}")
    rendered = tok.apply_chat_template(want["messages"], tokenize=False)
    template_ok = rendered == want["rendered"]
    if not template_ok:
        bad.append(f"template: {rendered!r} != {want['rendered']!r}")
    prompt = torch.tensor([want["prompt_ids"]])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=want["new_tokens"],
            min_new_tokens=want["new_tokens"],
            do_sample=False,
        )
    print(json.dumps({
        "encode_ok": not any(b.startswith("encode") for b in bad),
        "decode_ok": not any(b.startswith("decode") for b in bad),
        "template_ok": template_ok,
        "dtype": str(model.dtype).replace("torch.", ""),
        "generated": out[0, prompt.shape[1]:].tolist(),
        "bad": bad,
    }))


if __name__ == "__main__":
    main()
