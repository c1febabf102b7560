"""A small instruction set and a tokenizer with a chat template, for supervised fine-tuning
(docs/guide/fine-tuning.md, tests/integration/sft.rs). Nothing is downloaded: the examples are
generated arithmetic questions (some with a system message, some over two turns, some as
prompt/response pairs), and the tokenizer is a byte-level BPE trained on their text.

    python scripts/instructions.py --out data/sft

writes, in --out: train.jsonl and val.jsonl (one example a line), tokenizer.json, and
tokenizer_config.json with the chat template and the special tokens.
"""

import argparse
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Each message as <|role|>, a newline, its text and <|end|>; the generation prompt is the
# assistant's header (Zephyr's layout). raise_exception refuses a role it does not know.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}\n"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|assistant|>\n"
    "{% endif %}\n"
)

WORDS = ["plus", "minus", "times"]


def question(rng):
    a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice(WORDS)
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return f"What is {a} {op} {b}?", f"{a} {op} {b} is {value}."


def example(rng, i):
    q, a = question(rng)
    kind = i % 4
    if kind == 0:
        return {"prompt": f"Question: {q}\nAnswer:", "response": " " + a}
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if kind == 2:
        messages.insert(0, {"role": "system", "content": "You are a careful calculator."})
    if kind == 3:
        q2, a2 = question(rng)
        messages += [{"role": "user", "content": "And " + q2[0].lower() + q2[1:]},
                     {"role": "assistant", "content": a2}]
    return {"messages": messages}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=64, help="training examples")
    p.add_argument("--val", type=int, default=16, help="validation examples")
    p.add_argument("--vocab", type=int, default=320, help="the BPE's largest vocabulary")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    examples = [example(rng, i) for i in range(a.train + a.val)]
    for name, part in [("train.jsonl", examples[: a.train]), ("val.jsonl", examples[a.train:])]:
        with open(os.path.join(a.out, name), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in part)
    text = os.path.join(a.out, "tokenizer-text.txt")
    with open(text, "w") as f:
        for e in examples:
            parts = [e["prompt"], e["response"]] if "prompt" in e else [m["content"] for m in e["messages"]]
            f.write("\n".join(parts) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train([text], trainers.BpeTrainer(vocab_size=a.vocab, min_frequency=2, special_tokens=SPECIAL,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.remove(text)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|end|>",
              "pad_token": "<|endoftext|>", "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"{a.out}: {a.train} training and {a.val} validation examples, a BPE of {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
