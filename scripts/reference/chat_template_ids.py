"""Chat-template parity reference: the ids (and assistant masks) transformers'
`apply_chat_template` gives for a set of conversations, for tokenizer folders
in the layouts models come in.

usage: chat_template_ids.py SHARED_TOKENIZERS_DIR OUT_DIR
writes OUT_DIR/chats.jsonl (one {"messages", "tools"?} row per conversation),
OUT_DIR/<folder>/ (tokenizer files) and OUT_DIR/expected.json:
{folder: {"rows": [row numbers used], "ids": [[...]], "masks": [[...]] | null}}

Folders:
- phi3-shared: the shared phi-3-mini files as they are (a legacy
  SentencePiece-converted tokenizer.json, LlamaTokenizer class, template in
  tokenizer_config.json);
- phi3-jinja / phi3-config: phi-3 with a tool-calling ChatML template, saved
  by save_pretrained as chat_template.jinja / inside tokenizer_config.json;
- phi2-jinja: phi-2 (byte-level BPE, CodeGenTokenizer) with that template;
- named: a default template plus additional_chat_templates/tool_use.jinja
  (rows with tools render with tool_use);
- generation: a template marking assistant text with {% generation %}
  (assistant masks compared too).
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

from transformers import AutoTokenizer  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression <exactly>.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    }
]

CHATS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse.  Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?\n(just the name)"},
            {"role": "assistant", "content": " Rome"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Wie geht's? 😀 Ünïcödé — and 東京"},
            {"role": "assistant", "content": "Gut, danke!\n\n- one\n- two"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is 17 * 23?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23", "precise": True}}}
                ],
            },
            {"role": "tool", "name": "calculator", "content": "391"},
            {"role": "assistant", "content": "17 * 23 = 391."},
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "2+2 and 3+3?"},
            {
                "role": "assistant",
                "content": "Let me compute.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}},
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+3"}}},
                ],
            },
            {"role": "tool", "content": "4"},
            {"role": "tool", "content": "6"},
            {"role": "assistant", "content": "4 and 6."},
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "user", "content": "Think first: 9-3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "nine minus three is six"},
        ]
    },
]

GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}"
    "{%- generation %}"
    "{% if message.reasoning_content %}{{ '<think>' + message.reasoning_content + '</think>\n' }}{% endif %}"
    "{{ message['content'] + '<|end|>' }}"
    "{% endgeneration %}\n"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def main():
    shared, out = sys.argv[1:3]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chats.jsonl"), "w", encoding="utf-8") as f:
        for chat in CHATS:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    qwen = json.load(open(os.path.join(shared, "qwen2.5-chat-template", "tokenizer_config.json")))["chat_template"]

    def phi3():
        return AutoTokenizer.from_pretrained(os.path.join(shared, "phi-3-mini"))

    folders = {}
    d = os.path.join(out, "phi3-shared")
    os.makedirs(d, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(shared, "phi-3-mini", f), d)
    folders["phi3-shared"] = ([i for i, c in enumerate(CHATS) if "tools" not in c], False)

    t = phi3()
    t.chat_template = qwen
    t.save_pretrained(os.path.join(out, "phi3-jinja"))
    t.save_pretrained(os.path.join(out, "phi3-config"), save_jinja_files=False)
    folders["phi3-jinja"] = (list(range(len(CHATS))), False)
    folders["phi3-config"] = (list(range(len(CHATS))), False)

    t = AutoTokenizer.from_pretrained(os.path.join(shared, "phi-2"))
    t.chat_template = qwen
    t.save_pretrained(os.path.join(out, "phi2-jinja"))
    folders["phi2-jinja"] = (list(range(len(CHATS))), False)

    t = phi3()
    t.chat_template = {"default": t.chat_template, "tool_use": qwen}
    t.save_pretrained(os.path.join(out, "named"))
    folders["named"] = (list(range(len(CHATS))), False)

    t = phi3()
    t.chat_template = GENERATION_TEMPLATE
    t.save_pretrained(os.path.join(out, "generation"))
    folders["generation"] = ([i for i, c in enumerate(CHATS) if "tools" not in c], True)

    expected = {}
    for name, (rows, masks) in folders.items():
        tok = AutoTokenizer.from_pretrained(os.path.join(out, name))
        ids, ms = [], []
        for i in rows:
            chat = CHATS[i]
            res = tok.apply_chat_template(
                chat["messages"],
                tools=chat.get("tools"),
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=masks,
            )
            ids.append(list(res["input_ids"]))
            if masks:
                ms.append(list(res["assistant_masks"]))
        expected[name] = {"rows": rows, "ids": ids, "masks": ms if masks else None}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main()
