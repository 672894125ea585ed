"""BERT and T5 pretraining throughput next to HF transformers' models of the same shape, in one call.

    python bench/bench_encoders.py --json=bench/results/arch/encoders.json        # one GPU: base shapes
    python bench/bench_encoders.py --shape=tiny --device=cpu --steps=2 --warmup=1  # a CPU smoke run

Rows: "bert" (bert.Bert, the MLM head on the chosen positions only) and "bert-hf"
(BertForMaskedLM, its head on every position) on rows of --seq_len tokens, 15% of them targets;
"t5" (t5.T5) and "t5-hf" (T5ForConditionalGeneration) on sources of --seq_len tokens and targets of
--tgt_len (T5's pretraining pair: 512 -> 114). Same shape and parameter count (HF's config from
ours: bert.config_to_hf, t5.export_hf's keys; a v1.1 head untied in both), same random batches and seed, dropout 0.1 in all, bf16 autocast on CUDA (fp32
on CPU), AdamW (fused on CUDA) over all parameters, --compile for every row or none. Timed: --steps
optimizer steps after --warmup untimed ones (compilation happens there). Reported per row: tokens/s
(source tokens; --seq_len x batch per step), step time, peak memory, and MFU from ours's FLOP count
(bert.flops_per_token at the 15% predicted; t5.flops_per_row), the same count for the HF peer, so
the MFU columns compare wall time. Prints a table; --json writes every number.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logs  # noqa: E402
from encoders import bert  # noqa: E402
from encoders import t5  # noqa: E402
from fused import IGNORE  # noqa: E402

SHAPES = {  # bert-base-uncased; t5-v1_1-base (gated GELU, its own head)
    "base": dict(bert=dict(vocab_size=30522, n_layer=12, n_head=12, n_embd=768, ffn_hidden=3072, block_size=512),
                 t5=dict(vocab_size=32128, n_layer=12, n_head=12, n_embd=768, head_dim=64, ffn_hidden=2048,
                         activation="gated-gelu", tie_embeddings=False), seq_len=512, tgt_len=114, batch=32),
    "tiny": dict(bert=dict(vocab_size=512, n_layer=2, n_head=4, n_embd=64, ffn_hidden=128, block_size=64),
                 t5=dict(vocab_size=512, n_layer=2, n_head=4, n_embd=64, ffn_hidden=96, activation="gated-gelu",
                         tie_embeddings=False), seq_len=32, tgt_len=8, batch=2),
}
ROWS = ("bert", "bert-hf", "t5", "t5-hf")


def build(row, s):
    """-> (model, step_loss(x, y) -> loss, FLOPs per step) for one row."""
    import transformers
    B, T, L = s["batch"], s["seq_len"], s["tgt_len"]
    if row.startswith("bert"):
        cfg = bert.BertConfig(**s["bert"])
        flops = bert.flops_per_token(cfg, T, predicted=0.15) * B * T
        if row == "bert":
            model = bert.Bert(cfg)
            return model, lambda x, y: model(x, y), flops
        hf = transformers.BertConfig(**{k: v for k, v in bert.config_to_hf(cfg).items() if k != "architectures"})
        model = transformers.BertForMaskedLM(hf)
        return model, lambda x, y: model(input_ids=x, labels=y).loss, flops
    cfg = t5.T5Config(**s["t5"])
    flops = t5.flops_per_row(cfg, T, L) * B
    if row == "t5":
        model = t5.T5(cfg)
        return model, lambda x, y: model(x, y), flops
    hf = transformers.T5Config(vocab_size=cfg.vocab_size, d_model=cfg.n_embd, d_kv=cfg.head_dim, d_ff=cfg.ffn_hidden,
                               num_layers=cfg.n_layer, num_decoder_layers=cfg.decoder_layers, num_heads=cfg.n_head,
                               feed_forward_proj=cfg.activation, dropout_rate=cfg.dropout,
                               tie_word_embeddings=cfg.tie_embeddings, decoder_start_token_id=cfg.decoder_start_id)
    model = transformers.T5ForConditionalGeneration(hf)
    if not cfg.tie_embeddings and model.lm_head.weight is model.shared.weight:  # (transformers 5 ties it anyway)
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    return model, lambda x, y: model(input_ids=x, labels=y).loss, flops


def batches(row, s, n, device):
    """n random (inputs, targets) pairs, the same for a row and its HF peer (seeded by family)."""
    g = torch.Generator().manual_seed(0)
    B, T, L = s["batch"], s["seq_len"], s["tgt_len"]
    V = s["bert" if row.startswith("bert") else "t5"]["vocab_size"]
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T), generator=g)
        if row.startswith("bert"):
            y = torch.where(torch.rand(B, T, generator=g) < 0.15, x, torch.full_like(x, IGNORE))
        else:
            y = torch.randint(0, V, (B, L), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def run(row, s, args, device):
    torch.manual_seed(0)
    model, loss_of, flops = build(row, s)
    model = model.to(device).train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    step_fn = torch.compile(loss_of) if args.compile else loss_of
    data = batches(row, s, 3, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def step(i):
        x, y = data[i % len(data)]
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup):
        step(i)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    peak = logs.peak_tflops(device, args.peak_tflops)
    out = dict(row=row, params=sum(p.numel() for p in model.parameters()), step_ms=1e3 * dt,
               tok_s=s["batch"] * s["seq_len"] / dt, flops_per_step=flops, loss=loss.item(),
               mfu=flops / dt / (peak * 1e12) if peak else None,
               peak_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    model = opt = step_fn = loss_of = data = None  # (freed before the next row; not del: step() closes over them)
    if cuda:
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="base", choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per row")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per row (compilation happens here)")
    for k in ("batch", "seq_len", "tgt_len"):
        ap.add_argument(f"--{k}", type=int, default=None, help=f"override the shape's {k}")
    ap.add_argument("--compile", type=int, default=0, help="torch.compile every row's loss (1) or none (0)")
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="override the per-GPU peak for MFU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    s = dict(SHAPES[args.shape], **{k: getattr(args, k) for k in ("batch", "seq_len", "tgt_len")
                                    if getattr(args, k) is not None})
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    results = [run(r, s, args, device) for r in args.rows.split(",")]
    print(f"shape {args.shape}: batch {s['batch']}, seq_len {s['seq_len']} (T5 targets {s['tgt_len']}), "
          f"{device}, compile={args.compile}")
    print("| row | params | step ms | tokens/s | MFU | peak GiB | loss |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "-"
        print(f"| {r['row']} | {r['params'] / 1e6:.1f}M | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | {mfu} | {mem} | "
              f"{r['loss']:.3f} |")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(shape=args.shape, settings=s, device=str(device), compile=args.compile,
                           gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, rows=results), f,
                      indent=2)


if __name__ == "__main__":
    main()
