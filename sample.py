"""Generate text from a checkpoint, fill in the middle between a prefix and a suffix, or chat.

    python sample.py out/tiny                       # newest checkpoint of a run
    python sample.py out/tiny/step_000300 --prompt="def parse(" --n=3 --tokens=200 --temperature=0.7
    python sample.py out/fim --prefix=$'def add(a, b):\n' --suffix=$'\n    return c\n'    # infilling
    python sample.py out/sft_tiny --chat --prompt="What is 12 + 5?"     # one answer of a fine-tuned model
    python sample.py out/sft_tiny --chat --temperature=0                # a conversation: type, Enter; Ctrl-D ends

Chat (--chat): a model fine-tuned by sft.py (or an HF folder with a chat template) answers in its
own chat template (chat.setup: the one it was trained with), through generate.decode, until its
end-of-turn token; without --prompt it keeps the conversation going, turn by turn, from stdin.
A LoRA run's checkpoint is sampled with its adapters merged.

Infilling (a model trained with fim_rate > 0, or an HF model whose tokenizer has FIM sentinels)
prompts in SPM order, <PRE> <SUF> suffix <MID> prefix, or PSM order, <PRE> prefix <SUF> suffix <MID>
(fim.py; --fim_order), generates the middle until EOS (or a FIM sentinel, or --tokens) and prints
prefix + middle + suffix. The default is SPM for a model trained with SPM samples (fim_spm_rate > 0):
there the middle continues the prefix directly, and on held-out files the configs/small.py model
after 1,000 steps infilled in SPM order (the suffix cut the true line's bits/char from 1.39 to 1.28)
but not yet in PSM order (1.50, BENCHMARKS.md); PSM otherwise (the order HF code models use).
(bash's $'...' puts newlines into an argument.)
"""
import argparse
import os
import sys
from types import SimpleNamespace

import torch

import chat
import checkpoint
import config
import generate
import hf
import tokenizer
import weights
from corpora import fim
from corpora.corpus import DataError
from model import ModelConfig, Transformer


def load(path, device="cpu"):
    """A run folder, a checkpoint folder or an HF model folder -> (model in eval mode, tokenizer, cfg);
    a model family that does not continue prompts (weights.Family.no_sample) is refused in one line."""
    if hf.is_hf_folder(path):
        refuse_family(path, weights.folder_family(path))
        model = hf.load_hf(path, device)
        return model, tokenizer.load_hf_tokenizer(path), model.cfg
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        found = checkpoint.latest(path)
        if found is None:
            raise config.MissingFileError(f"'{path}' is neither a checkpoint folder, a run folder with checkpoints "
                                          "nor an HF model folder: name one (e.g. out/tiny)")
        path = found
    cfg = SimpleNamespace(**hf.read_config(path))
    fam = refuse_family(path, weights.family(cfg))
    model = Transformer(ModelConfig.from_cfg(cfg))
    weights.load_model(path, model, fam)
    tok = tokenizer.for_cfg(cfg)  # FIM sentinels when it was trained with them
    return model.to(device).eval(), tok, cfg


def refuse_family(path, fam):
    if fam.no_sample:
        raise config.UserError(f"{path}: {fam.no_sample}; sample.py continues prompts with a decoder")
    return fam


def chat_setup(path, cfg):
    """(tokenizer with the chat template's special tokens, template) of a model loaded by load()."""
    keys = dict(init_from=path, tokenizer=path, tokenizer_vocab=0) if hf.is_hf_folder(path) else {}
    settings = SimpleNamespace(**{**chat.CHAT_DEFAULTS, **vars(cfg), **keys})  # a pretraining checkpoint has no chat keys
    tok, template = chat.setup(settings)
    if tok.n_vocab > cfg.vocab_size:
        raise SystemExit(f"error: {path} was not fine-tuned for chat (its vocabulary lacks the template's special "
                         f"tokens {template.special_tokens}): fine-tune it with sft.py first")
    return tok, template


def converse(model, tok, template, a):
    """--chat: answer --prompt once (--n samples), or hold a conversation read from stdin."""
    messages = [{"role": "system", "content": a.system}] if a.system else []
    turns = [a.prompt] if a.prompt else (line.rstrip("\n") for line in sys.stdin)
    if not a.prompt:
        print("chat: type a message, Enter to send; Ctrl-D ends", file=sys.stderr)
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = chat.encode(tok, template, messages, add_generation_prompt=True)[0]
        new = min(a.tokens, model.cfg.block_size - len(ids))
        if new <= 0:
            raise SystemExit(f"error: the conversation has {len(ids)} tokens, block_size is {model.cfg.block_size}")
        r = generate.decode(model, [ids], new, vocab=tok, n=a.n if a.prompt else 1, temperature=a.temperature,
                            top_k=a.top_k, top_p=a.top_p, stop_tokens=[tok.eot_id], pad_id=tok.eot_id, seed=a.seed)
        answers = [tok.decode([t for t in row[:n] if t != tok.eot_id])
                   for row, n in zip(r.tokens[:, r.prompt_len:].tolist(), r.lengths.tolist())]
        for i, answer in enumerate(answers):
            print(f"--- answer {i} ---\n{answer}" if a.prompt else f"assistant: {answer}", flush=True)
        messages.append({"role": "assistant", "content": answers[0]})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="run folder (out/<run>), checkpoint folder (out/<run>/step_N) or HF model folder")
    p.add_argument("--prompt", default="")
    p.add_argument("--prefix", default=None, help="infilling: the text before the gap (with --suffix)")
    p.add_argument("--suffix", default=None, help="infilling: the text after the gap (with --prefix)")
    p.add_argument("--fim_order", default="auto", choices=("auto", "spm", "psm"),
                   help="infilling prompt order; auto: spm if the model was trained with SPM samples, else psm")
    p.add_argument("--n", type=int, default=1, help="number of samples")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chat", action="store_true", help="talk to a fine-tuned model in its chat template")
    p.add_argument("--system", default="", help="--chat: a system message first")
    a = p.parse_args(argv)
    if a.chat:
        if a.prefix is not None or a.suffix is not None:
            p.error("--chat answers messages; --prefix/--suffix fill in a middle: give one or the other")
        model, _, cfg = load(a.path, a.device)
        return converse(model, *chat_setup(a.path, cfg), a)
    infill = a.prefix is not None or a.suffix is not None
    if infill and a.prompt:
        p.error("--prompt continues text; --prefix/--suffix fill in a middle: give one or the other")
    model, tok, cfg = load(a.path, a.device)
    stops = [tok.eos_id]
    if infill:
        if getattr(cfg, "fim_rate", None) == 0:
            p.error(f"{a.path} was trained without fill-in-the-middle (fim_rate=0): infilling needs a model "
                    "trained with fim_rate > 0 (e.g. --fim_rate=0.5 in pretrain.py)")
        spm_rate = getattr(cfg, "fim_spm_rate", None)  # None: an HF model, its training unknown
        if a.fim_order == "spm" and spm_rate == 0:
            p.error(f"--fim_order=spm: {a.path} was trained without SPM samples (fim_spm_rate=0): use --fim_order=psm")
        spm = a.fim_order == "spm" or (a.fim_order == "auto" and (spm_rate or 0) > 0)
        try:
            ids = fim.prompt(tok, a.prefix or "", a.suffix or "", spm=spm)
        except DataError as e:
            p.error(str(e))
        stops += list(tokenizer.fim_sentinels(tok))
    else:
        ids = tok.encode(a.prompt) or [tok.eos_id]
    new = min(a.tokens, cfg.block_size - len(ids))
    if new <= 0:
        p.error(f"the prompt has {len(ids)} tokens, block_size is {cfg.block_size}: shorten it")
    out = generate.decode(model, [ids], new, vocab=tok, n=a.n, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          stop_tokens=stops, seed=a.seed).tokens  # the fast decoder (generate.py)
    for i, row in enumerate(out.tolist()):
        gen = row[len(ids):]
        stop = next((j for j, t in enumerate(gen) if t in stops), None)
        gen = gen[:stop]
        if infill:
            end = f"no EOS within {new} tokens" if stop is None else \
                "stopped at EOS" if row[len(ids) + stop] == tok.eos_id else "stopped at a FIM sentinel"
            print(f"--- sample {i}: middle of {len(gen)} tokens ({'SPM' if spm else 'PSM'} order), {end} ---\n"
                  f"{a.prefix or ''}{tok.decode(gen)}{a.suffix or ''}")
        else:
            print(f"--- sample {i} ---\n{tok.decode(row[:len(ids)] + gen)}")


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])  # a mistake to fix (a UserError) prints one line, no traceback
