"""A tiny Llama-style model for pipelines/llama_finetune.toml, and text from a Hugging Face model
directory: the two Python steps of docs/guide/hugging-face.md. Nothing is downloaded: the model is
made from a config with random weights (transformers' own initialisation, seeded).

    python scripts/tiny_llama.py make --vocab 512 --out models/tiny-llama
    python scripts/tiny_llama.py generate tempest-llama --prompt "PROSPERO:" --tokens 40
    python scripts/tiny_llama.py generate models/tiny-llama --adapter tempest-lora --prompt "PROSPERO:"

`generate` decodes greedily (the most likely token each time, as `runner predict --top-k 1`) with
the directory's own tokenizer, and prints the prompt and what follows it. With `--adapter`, the
model is the directory's with PEFT's LoRA adapter loaded over it (`PeftModel.from_pretrained`; as
`runner export --peft` writes one, with the run's tokenizer): docs/guide/fine-tuning.md.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM


def make(a):
    torch.manual_seed(a.seed)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.d_model, intermediate_size=a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.positions, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config)
    model.save_pretrained(a.out, max_shard_size=a.max_shard_size)
    print(f"{a.out}: LlamaForCausalLM of {sum(p.numel() for p in model.parameters())} parameters")


def generate(a):
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(a.adapter or a.dir)
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32)
    if a.adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, a.adapter)
    ids = tokenizer(a.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=a.tokens, min_new_tokens=a.tokens)
    print(tokenizer.decode(out[0]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="a tiny LlamaForCausalLM with random weights, saved to --out")
    m.add_argument("--out", required=True)
    for name, default in [("vocab", 512), ("d-model", 64), ("layers", 2), ("heads", 4),
                          ("kv-heads", 2), ("hidden", 176), ("positions", 256), ("seed", 0)]:
        m.add_argument(f"--{name}", type=int, default=default)
    m.add_argument("--max-shard-size", default="50GB", help="shards past this size, with an index")
    g = sub.add_parser("generate", help="greedy text from a model directory and its tokenizer")
    g.add_argument("dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--tokens", type=int, default=40)
    g.add_argument("--adapter", help="a PEFT adapter directory to load over the model")
    a = p.parse_args()
    {"make": make, "generate": generate}[a.command](a)


if __name__ == "__main__":
    main()
