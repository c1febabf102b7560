"""PEFT's LoRA on transformers: the twin of the runner's `[wrap.lora]` (tests/integration/lora.rs).
Nothing is downloaded: the base model is a tiny checkpoint made locally (tests/fixtures/hf_twin.py
make, or scripts/tiny_llama.py).

    peft_lora.py init  BASE --out DIR --r R --alpha A --targets q_proj,v_proj [--seed S]
        adapters as PEFT makes them, saved with save_pretrained; with --random-b, B random too
        (init_lora_weights=False: nn.Linear's own initialisation), so that step 0 already differs
        from the base model
    peft_lora.py train BASE --adapter DIR --windows FILE [--steps N] [AdamW options]
        the adapters loaded trainable over BASE, N steps of torch.optim.AdamW on the windows (the
        same batch every step); the losses
    peft_lora.py check BASE --adapter DIR [--merged HF_DIR] [--windows FILE --logits-out FILE]
        the adapter directory loaded by PeftModel.from_pretrained: its missing and unexpected
        keys; with --merged, the largest difference between merge_and_unload()'s weights and
        HF_DIR's (a merged export, loaded by AutoModelForCausalLM), and the merged model's
        greedy generation

`--windows FILE` is a .safetensors file with `x` (int64, windows x seq_len) and `y` (the next
tokens). Each command prints one JSON object on its last line.
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def base(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def init(a):
    torch.manual_seed(a.seed)
    config = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=a.targets.split(","),
                        init_lora_weights=not a.random_b)
    model = get_peft_model(base(a.base), config)
    model.save_pretrained(a.out)
    return {"files": sorted(os.listdir(a.out)),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def train(a):
    torch.set_num_threads(1)
    model = PeftModel.from_pretrained(base(a.base), a.adapter, is_trainable=True)
    windows = load_file(a.windows)
    x, y = windows["x"], windows["y"]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.betas), eps=a.eps,
                            weight_decay=a.weight_decay)
    losses = []
    for _ in range(a.steps):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "trainable": sum(p.numel() for p in params)}


def check(a):
    torch.set_num_threads(1)
    model = PeftModel.from_pretrained(base(a.base), a.adapter)
    # Loaded again through PEFT's own loader, which says what did not fit.
    loaded = set_peft_model_state_dict(model, load_peft_weights(a.adapter))
    result = {"missing_keys": sorted(k for k in loaded.missing_keys if "lora_" in k),
              "unexpected_keys": sorted(loaded.unexpected_keys),
              "config": json.load(open(os.path.join(a.adapter, "adapter_config.json")))}
    model.eval()
    if a.windows:
        with torch.no_grad():
            save_file({"logits": model(input_ids=load_file(a.windows)["x"]).logits.contiguous()},
                      a.logits_out)
    if a.merged:
        merged = model.merge_and_unload().state_dict()
        theirs = AutoModelForCausalLM.from_pretrained(a.merged, dtype=torch.float32)
        ours = theirs.state_dict()
        result["merged_keys"] = sorted(set(merged) ^ set(ours))
        result["merged_diff"] = max((merged[k] - ours[k]).abs().max().item() for k in merged if k in ours)
        with torch.no_grad():
            out = theirs.generate(torch.tensor([[116, 111]]), do_sample=False, max_new_tokens=4,
                                  min_new_tokens=4, pad_token_id=0)
        result["generated"] = out[0, 2:].tolist()
    return result


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init")
    i.add_argument("base")
    i.add_argument("--out", required=True)
    i.add_argument("--r", type=int, default=8)
    i.add_argument("--alpha", type=float, default=8.0)
    i.add_argument("--targets", default="q_proj,v_proj")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--random-b", action="store_true")
    t = sub.add_parser("train")
    t.add_argument("base")
    t.add_argument("--adapter", required=True)
    t.add_argument("--windows", required=True)
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=0.002)
    t.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
    t.add_argument("--eps", type=float, default=1e-8)
    t.add_argument("--weight-decay", type=float, default=0.01)
    c = sub.add_parser("check")
    c.add_argument("base")
    c.add_argument("--adapter", required=True)
    c.add_argument("--merged")
    c.add_argument("--windows")
    c.add_argument("--logits-out")
    a = p.parse_args()
    print(json.dumps({"init": init, "train": train, "check": check}[a.command](a)))


if __name__ == "__main__":
    main()
