"""Generate text from a checkpoint.

    python sample.py out/tiny                       # newest checkpoint of a run
    python sample.py out/tiny/step_000300 --prompt="def parse(" --n=3 --tokens=200 --temperature=0.7
"""
import argparse
import json
import os
from types import SimpleNamespace

import torch

import checkpoint
import data
import generate
import hf
from model import ModelConfig, Transformer


def load(path, device="cpu"):
    """A run folder, a checkpoint folder or an HF model folder -> (model in eval mode, tokenizer, cfg)."""
    if hf.is_hf_folder(path):
        model = hf.load_hf(path, device)
        return model, hf.load_hf_tokenizer(path), model.cfg
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        found = checkpoint.latest(path)
        if found is None:
            raise FileNotFoundError(f"'{path}' is neither a checkpoint folder nor a run folder with checkpoints")
        path = found
    with open(os.path.join(path, "config.json")) as f:
        cfg = SimpleNamespace(**json.load(f))
    model = Transformer(ModelConfig.from_cfg(cfg))
    checkpoint.load_model(path, model)
    tok = data.get_tokenizer(cfg.tokenizer, cfg.tokenizer_vocab)
    return model.to(device).eval(), tok, cfg


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="run folder (out/<run>), checkpoint folder (out/<run>/step_N) or HF model folder")
    p.add_argument("--prompt", default="")
    p.add_argument("--n", type=int, default=1, help="number of samples")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    model, tok, cfg = load(a.path, a.device)
    ids = tok.encode(a.prompt) or [tok.eos_id]
    x = torch.tensor([ids] * a.n, device=a.device)
    new = min(a.tokens, cfg.block_size - x.shape[1])
    if new <= 0:
        raise ValueError(f"prompt has {x.shape[1]} tokens, block_size is {cfg.block_size}: shorten the prompt")
    torch.manual_seed(a.seed)
    out = generate.generate(model, x, new, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            stop_tokens=[tok.eos_id])
    for i, row in enumerate(out.tolist()):
        row = row[: row.index(tok.eos_id, len(ids))] if tok.eos_id in row[len(ids):] else row
        print(f"--- sample {i} ---\n{tok.decode(row)}")


if __name__ == "__main__":
    main()
