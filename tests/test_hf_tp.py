"""hf.py under tensor parallelism: TP=2 on 2 gloo processes against transformers itself.

Proves: for GPT-2, LLaMA, LLaMA with Llama-3.1 rope scaling, Qwen2 (q/k/v bias, tied head, sharded
safetensors) and Mistral, an HF folder read with tp.hf_shard_fn into a TP=2 model gives every rank
only its slices (its q/k/v heads, its 64 of the 128 padded vocabulary rows), and the gathered
logits equal transformers' (fp32, max abs diff <= 1e-4) on every rank; greedy generation under
TP=2 equals transformers' generate token for token.

The builders and references come from test_hf.py; the spawned worker lives here, in a module that
does not import transformers, so the two processes start in half the time.
"""
import os
from types import SimpleNamespace

import torch
from distributed import spawn

import generate
import hf
import parallel
from model import Transformer
from parallelism import tp

GEN = "qwen2"  # the architecture whose greedy generation is also compared


@torch.no_grad()
def _worker(rank, folders, x, prompt, out_dir):
    """One of 2 ranks: each HF folder read into a TP=2 model, this rank's slices only."""
    grid = parallel.init(SimpleNamespace(device="cpu", tp=2, ep=1))
    out = {}
    for name, folder in folders.items():
        model = tp.tensor_parallel(Transformer(hf.config_from_hf(hf.read_config(folder))), grid)
        hf.load_weights(folder, model, shard_fn=tp.hf_shard_fn(model, grid))
        model.eval()
        out[name] = {"logits": model(x), "qkv": model.blocks[0].attn.qkv.weight, "emb": model.tok_emb.weight}
        if name == GEN:
            out[name]["gen"] = generate.generate(model, prompt, 12, vocab=model.cfg.vocab_size, temperature=0)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@torch.no_grad()
def test_tp2_logits_match(tmp_path):
    from test_hf import ARCHS, assert_close, build, ids  # skips when transformers is missing
    refs = {name: build(name, tmp_path / name) for name in ARCHS}
    x, prompt = ids(1), ids(3, (3, 6))
    spawn(_worker, 2, {name: folder for name, (_, folder) in refs.items()}, x, prompt, str(tmp_path))
    gen = refs[GEN][0].generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for name, (ref, folder) in refs.items():
        expected, full = ref(x).logits, hf.load_hf(folder)
        H, KV, D = full.cfg.n_head, full.cfg.kv_heads, full.cfg.head_dim
        qkv, emb = full.blocks[0].attn.qkv.weight, full.tok_emb.weight
        assert full.cfg.padded_vocab == 128  # vocabulary 97 padded to a multiple of 64: 64 rows per rank
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert_close(got["logits"], expected)
            assert got["qkv"].shape[0] == qkv.shape[0] // 2, f"{name} rank {rank}: qkv holds more than its rows"
            assert torch.equal(got["qkv"], tp.cut(qkv, 0, [(H * D, 2), (KV * D, 2), (KV * D, 2)], rank, 2)), \
                f"{name} rank {rank}: not its q/k/v heads"
            assert torch.equal(got["emb"], emb[64 * rank:64 * (rank + 1)]), f"{name} rank {rank}: vocabulary rows"
            if name == GEN:
                assert torch.equal(got["gen"], gen), f"rank {rank}: greedy generation"
