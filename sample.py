"""Generate text from a checkpoint, or fill in the middle between a prefix and a suffix.

    python sample.py out/tiny                       # newest checkpoint of a run
    python sample.py out/tiny/step_000300 --prompt="def parse(" --n=3 --tokens=200 --temperature=0.7
    python sample.py out/fim --prefix=$'def add(a, b):\n' --suffix=$'\n    return c\n'    # infilling

Infilling (a model trained with fim_rate > 0, or an HF model whose tokenizer has FIM sentinels)
prompts in PSM order, <PRE> prefix <SUF> suffix <MID> (fim.py), generates the middle until EOS
(or a FIM sentinel, or --tokens) and prints prefix + middle + suffix. (bash's $'...' puts newlines
into an argument.)
"""
import argparse
import json
import os
from types import SimpleNamespace

import torch

import checkpoint
import data
import fim
import generate
import hf
from corpus import DataError
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
    tok = data.tokenizer_for(cfg)  # FIM sentinels when it was trained with fim_rate > 0
    return model.to(device).eval(), tok, cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="run folder (out/<run>), checkpoint folder (out/<run>/step_N) or HF model folder")
    p.add_argument("--prompt", default="")
    p.add_argument("--prefix", default=None, help="infilling: the text before the gap (with --suffix)")
    p.add_argument("--suffix", default=None, help="infilling: the text after the gap (with --prefix)")
    p.add_argument("--n", type=int, default=1, help="number of samples")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    infill = a.prefix is not None or a.suffix is not None
    if infill and a.prompt:
        p.error("--prompt continues text; --prefix/--suffix fill in a middle: give one or the other")
    model, tok, cfg = load(a.path, a.device)
    stops = [tok.eos_id]
    if infill:
        if getattr(cfg, "fim_rate", None) == 0:
            p.error(f"{a.path} was trained without fill-in-the-middle (fim_rate=0): infilling needs a model "
                    "trained with fim_rate > 0 (e.g. --fim_rate=0.5 in pretrain.py)")
        try:
            ids = fim.prompt(tok, a.prefix or "", a.suffix or "")
        except DataError as e:
            p.error(str(e))
        stops += list(fim.sentinels(tok))
    else:
        ids = tok.encode(a.prompt) or [tok.eos_id]
    new = min(a.tokens, cfg.block_size - len(ids))
    if new <= 0:
        p.error(f"the prompt has {len(ids)} tokens, block_size is {cfg.block_size}: shorten it")
    out = generate.decode(model, [ids], new, n=a.n, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          stop_tokens=stops, seed=a.seed).tokens  # the fast decoder (generate.py)
    for i, row in enumerate(out.tolist()):
        gen = row[len(ids):]
        stop = next((j for j, t in enumerate(gen) if t in stops), None)
        gen = gen[:stop]
        if infill:
            end = f"no EOS within {new} tokens" if stop is None else \
                "stopped at EOS" if row[len(ids) + stop] == tok.eos_id else "stopped at a FIM sentinel"
            print(f"--- sample {i}: middle of {len(gen)} tokens, {end} ---\n"
                  f"{a.prefix or ''}{tok.decode(gen)}{a.suffix or ''}")
        else:
            print(f"--- sample {i} ---\n{tok.decode(row[:len(ids)] + gen)}")


if __name__ == "__main__":
    main()
