"""The Python twin of the runner's instruction data (tests/integration/sft.rs): each example
rendered by transformers' `tokenizer.apply_chat_template`, its labels masked as TRL's
`DataCollatorForCompletionOnlyLM` masks them, and the masked loss of a model on them.

    python benches/reference/sft_twin.py render DATA_DIR FILE.jsonl
    python benches/reference/sft_twin.py loss MODEL_DIR DATA_DIR FILE.jsonl --examples 48 --seq-len 64
    python benches/reference/sft_twin.py exported EXPORT_DIR DATA_DIR FILE.jsonl

`render` prints, per example, the text, the token ids and whether each token's label counts.
`loss` prints the loss of the first --examples examples (cut to seq-len + 1 tokens): per example,
transformers' own `model(input_ids, labels=labels).loss` (the mean over its counted targets),
then their mean, as the runner's first step computes it; with --packed, each example run alone
through the model and a window's loss the mean over the counted targets of its examples (what
packing with a block-diagonal mask and positions from 0 per example must give). `exported` counts the examples that a
`runner export --hf` directory's tokenizer renders and tokenizes as the data's own tokenizer does.

The collator was removed from TRL (0.20); its masking is written out below as TRL 0.19's
`torch_call` does it: with an instruction template, every span from an instruction template to the
end of the next response template is ignored (from the start for the first), and after the last
response template's end everything counts up to the next instruction template. A prompt/response
pair is masked as TRL's prompt-completion data: the prompt's tokens ignored, the response's and
the end-of-sequence token's counted.
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE = -100
RESPONSE_TEMPLATE = "<|assistant|>\n"
INSTRUCTION_TEMPLATE = "<|user|>\n"


def find(ids, template):
    return [i for i in range(len(ids)) if ids[i:i + len(template)] == template]


def completion_only_labels(ids, response_ids, instruction_ids):
    """TRL 0.19's DataCollatorForCompletionOnlyLM.torch_call, for one example."""
    labels = list(ids)
    responses = [i + len(response_ids) for i in find(ids, response_ids)]
    humans = find(ids, instruction_ids)
    if not responses:
        return [IGNORE] * len(ids)
    if humans and responses and humans[0] > responses[0]:
        humans = [0] + humans
    for k, (start, end) in enumerate(zip(humans, responses)):
        labels[(start if k else 0):end] = [IGNORE] * (end - (start if k else 0))
    if len(responses) < len(humans):
        labels[humans[-1]:] = [IGNORE] * (len(labels) - humans[-1])
    return labels


def encode(tok, example):
    if "messages" in example:
        text = tok.apply_chat_template(example["messages"], tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == tok.apply_chat_template(example["messages"], tokenize=True, return_dict=True)["input_ids"]
        enc = lambda s: tok(s, add_special_tokens=False).input_ids
        labels = completion_only_labels(ids, enc(RESPONSE_TEMPLATE), enc(INSTRUCTION_TEMPLATE))
    else:
        text = example["prompt"] + example["response"] + tok.eos_token
        ids = tok(text, add_special_tokens=False).input_ids
        prompt = tok(example["prompt"], add_special_tokens=False).input_ids
        assert ids[:len(prompt)] == prompt, "the prompt's tokens are not a prefix of the whole"
        labels = [IGNORE] * len(prompt) + ids[len(prompt):]
    return text, ids, [label != IGNORE for label in labels]


def read(path):
    with open(path) as f:
        return [(i + 1, json.loads(line)) for i, line in enumerate(f) if line.strip()]


def render(a):
    tok = AutoTokenizer.from_pretrained(a.data)
    out = []
    for line, example in read(a.file):
        text, ids, counted = encode(tok, example)
        out.append({"line": line, "text": text, "ids": ids, "counted": counted})
    print(json.dumps(out))


def loss(a):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.data)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.eval()
    sums = []  # per example: (the sum of its counted targets' losses, their count)
    for _, example in read(a.file)[:a.examples]:
        _, ids, counted = encode(tok, example)
        ids, counted = ids[:a.seq_len + 1], counted[:a.seq_len + 1]
        labels = torch.tensor([[i if c else IGNORE for i, c in zip(ids, counted)]])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), labels=labels)
            each = F.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=IGNORE, reduction="sum")
        n = int((labels[0, 1:] != IGNORE).sum())
        assert abs(each.item() / n - out.loss.item()) < 1e-6, "transformers' loss is the mean over counted targets"
        sums.append((each.double().item(), n, len(ids) - 1))
    if a.packed:
        # The runner's windows: examples in order, a new window when the next does not fit; a
        # window's loss is the mean over all its counted targets.
        windows, used = [], a.seq_len
        for s, n, width in sums:
            if used + width > a.seq_len:
                windows.append([0.0, 0])
                used = 0
            windows[-1][0] += s
            windows[-1][1] += n
            used += width
        losses = [s / n for s, n in windows]
    else:
        losses = [s / n for s, n, _ in sums]
    print(json.dumps({"losses": losses, "loss": sum(losses) / len(losses)}))


def exported(a):
    """The exported model directory's tokenizer renders and tokenizes every example as the data's."""
    ours, theirs = AutoTokenizer.from_pretrained(a.export), AutoTokenizer.from_pretrained(a.data)
    same = sum(encode(ours, e) == encode(theirs, e) for _, e in read(a.file))
    config = json.load(open(os.path.join(a.export, "config.json")))
    print(json.dumps({"same": same, "examples": len(read(a.file)),
                      "eos": [config.get("eos_token_id"), ours.eos_token_id, theirs.eos_token_id]}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render")
    r.add_argument("data")
    r.add_argument("file")
    s = sub.add_parser("loss")
    s.add_argument("model")
    s.add_argument("data")
    s.add_argument("file")
    s.add_argument("--examples", type=int, required=True)
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--packed", action="store_true", help="the loss of the examples packed into windows")
    e = sub.add_parser("exported")
    e.add_argument("export")
    e.add_argument("data")
    e.add_argument("file")
    a = p.parse_args()
    {"render": render, "loss": loss, "exported": exported}[a.command](a)


if __name__ == "__main__":
    main()
