"""Both final models of benches/reference/nanogpt.sh on the same validation batches, through
nanoGPT's own model code (model.py of the fetched copy, never part of this repository).

    python nanogpt_eval.py NANOGPT_DIR VAL_BIN NANOGPT_CKPT RUNNER_MODEL_SAFETENSORS [--batches 200]

nanoGPT's checkpoint loads as its train.py saved it; the runner's model.safetensors is renamed
into nanoGPT's GPT (tok → transformer.wte, pos → wpe, blocks.i.ln1/qkv/proj/ln2/fc/out → h.i.ln_1,
attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj; the head tied to wte). The batches: 200 of
12 windows of block_size + 1 tokens at offsets drawn from numpy's RandomState(0), as get_batch
draws them. Prints one line per model: `NAME val_loss L`.
"""

import argparse
import sys

import numpy as np
import torch
from safetensors.torch import load_file


def runner_to_nanogpt(sd):
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        if parts[0] == "tok":
            out["transformer.wte.weight"] = t
            out["lm_head.weight"] = t
        elif parts[0] == "pos":
            out["transformer.wpe.weight"] = t
        elif parts[0] == "ln_f":
            out["transformer.ln_f." + parts[1]] = t
        elif parts[0] == "blocks":
            sub = {"ln1": "ln_1", "qkv": "attn.c_attn", "proj": "attn.c_proj", "ln2": "ln_2", "fc": "mlp.c_fc",
                   "out": "mlp.c_proj"}[parts[2]]
            out[f"transformer.h.{parts[1]}.{sub}.{parts[3]}"] = t
        else:
            raise SystemExit(f"unexpected parameter {name}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("nanogpt")
    p.add_argument("val")
    p.add_argument("ckpt")
    p.add_argument("runner_model")
    p.add_argument("--batches", type=int, default=200)
    a = p.parse_args()
    sys.path.insert(0, a.nanogpt)
    from model import GPT, GPTConfig

    ckpt = torch.load(a.ckpt, map_location="cpu")
    config = GPTConfig(**ckpt["model_args"])
    theirs = GPT(config)
    theirs.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    ours = GPT(config)
    ours.load_state_dict(runner_to_nanogpt(load_file(a.runner_model)))

    data = np.memmap(a.val, dtype=np.uint16, mode="r")
    rng = np.random.RandomState(0)
    t, b = config.block_size, 12
    batches = []
    for _ in range(a.batches):
        ix = rng.randint(0, len(data) - t, size=b)
        x = torch.stack([torch.from_numpy(data[i : i + t].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + t].astype(np.int64)) for i in ix])
        batches.append((x, y))
    for name, model in [("nanogpt", theirs), ("runner", ours)]:
        model.eval()
        with torch.no_grad():
            losses = [model(x, y)[1].item() for x, y in batches]
        print(f"{name} val_loss {np.mean(losses):.4f}", flush=True)


if __name__ == "__main__":
    main()
