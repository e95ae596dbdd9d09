"""Chat templates as the Hugging Face Hub ships them (written out here: tests have no network),
conversations that exercise them, and a small tokenizer that knows their special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Llama 2's: the system turn folds into the first user turn, Python string methods, whitespace
# control.
LLAMA2_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
# ChatML with transformers' assistant marker, on lines of their own as templates write it.
CHATML_GENERATION = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Messages as JSON and as dict items, as tool-calling templates write them: Python's json.dumps
# (transformers' tojson) and keys in the order written.
TOJSON_ITEMS = (
    "{%- for message in messages %}{{ message['role'] }}: {{ message | tojson }}\n"
    "{%- for key, value in message.items() %}{{ key }}={{ value | tojson(indent=2) }};"
    "{%- endfor %}{{ [message, {'n': [1, 2.5, none, true]}] | tojson(indent=1) }}{{ eos_token }}\n"
    "{%- endfor %}{%- if add_generation_prompt %}assistant: {%- endif %}"
)

TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": (QWEN2, None, "<|im_end|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "llama2_system": (LLAMA2_SYSTEM, "<s>", "</s>"),
    "chatml_generation": (CHATML_GENERATION, None, "<|im_end|>"),
    "tojson_items": (TOJSON_ITEMS, None, "<|endoftext|>"),
}
"""Name: (template, bos_token, eos_token)."""

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "  Colour of the sky?\n"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
        {"role": "assistant", "content": " Green \n\n"},
    ],
    [
        {"role": "user", "content": "Traduis « naïve café » en 日本語 🦀"},
        {"role": "assistant", "content": "ナイーブなカフェ 🦀\n\tdone", "name": None},
    ],
    [
        {"role": "user", "content": "def f(x):\n    return x * 2\n\nWhat does f(3) give?"},
        {"role": "assistant", "content": "f(3) returns 6:\n```python\n>>> f(3)\n6\n```"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ],
]


def without_system(conversation: list[dict]) -> list[dict]:
    """The conversation for templates that know no system turn (Mistral's)."""
    return [message for message in conversation if message["role"] != "system"]


def conversations_for(name: str) -> list[list[dict]]:
    if name == "mistral":
        return [without_system(c) for c in CONVERSATIONS]
    return CONVERSATIONS


def write_tokenizer(directory: Path, name: str) -> Path:
    """A byte-level BPE trained on the conversations, with every template's special tokens, and
    a tokenizer_config.json holding template `name` and its BOS and EOS tokens. Qwen2's trims
    whitespace off its offsets, as GPT-2's does."""
    template, bos, eos = TEMPLATES[name]
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if name == "qwen2":  # offsets trimmed of whitespace, as GPT-2's: masks from the offsets
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_chat_jsonl(path: Path, conversations: list[list[dict]]) -> Path:
    lines = [
        json.dumps({"id": i, "messages": c}, ensure_ascii=False)
        for i, c in enumerate(conversations)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
