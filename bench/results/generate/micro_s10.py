"""Decode-step micro benchmarks on the GPU (session 10, issue 16): fused.decode_attention's chunk and
warps against SDPA's cuDNN kernel, top-k in two rounds against torch.topk, and the whole decoder with
each change on and off. Every timing from CUDA-graph replays (12 calls per graph). The timing
harness (bench, section) is micro_s8.py's, copied: each script in bench/results stays the record of
the run it made (micro_attention_a0b417f.*: this file at a0b417f; micro_step_07da82a.*: at 07da82a)."""
import json, os, sys, time, traceback
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

dev, dt = "cuda", torch.bfloat16
RES = {}
OUT = os.environ.get("OUT", "/tmp")


def save():
    json.dump(RES, open(os.path.join(OUT, "micro_s10.json"), "w"), indent=1, default=str)


def bench(fn, iters=50, reps=12):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / iters / reps


def section(name):
    def deco(f):
        if os.environ.get("SKIP", "") and name in os.environ["SKIP"].split(","):
            return f
        try:
            t = time.time(); f(); print(f"[{name}] {time.time()-t:.1f}s", flush=True)
        except Exception:
            traceback.print_exc()
        save()
        return f
    return deco


x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
bw = 2 * x.numel() / (bench(lambda: y.copy_(x)) * 1e-6)
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True); del x, y
RES["copy_bw"] = bw
import fused
import generate


@section("attention")
def _():
    for shape, (R, H, KV, D, S) in {"124m": (64, 12, 12, 64, 320), "1b": (64, 16, 8, 128, 320)}.items():
        g = torch.Generator(dev).manual_seed(0)
        kbuf = torch.randn(R, KV, S, D, device=dev, dtype=dt, generator=g)
        vbuf = torch.randn(R, KV, S, D, device=dev, dtype=dt, generator=g)
        q = torch.randn(R, H, 1, D, device=dev, dtype=dt, generator=g)
        pad = torch.randint(0, 12, (R,), device=dev, generator=g)
        for L in (128, 192, 256, 320):
            j = torch.arange(S, device=dev)
            keep = (j[None] >= pad[:, None]) & (j[None] <= L - 10)
            bias = torch.zeros(R, S, device=dev, dtype=dt).masked_fill_(~keep, float("-inf"))
            k, v, b = kbuf[:, :, :L], vbuf[:, :, :L], bias[:, None, None, :L]
            G = H // KV
            ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(G, 1),
                                                 v.float().repeat_interleave(G, 1), attn_mask=b.float())
            out = {}
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    if G > 1:  # model.Attention's GQA decode: query heads of a kv head as query rows
                        fn = lambda: F.scaled_dot_product_attention(q.reshape(R, KV, G, D), k, v, attn_mask=b)
                        o = fn().reshape(R, H, 1, D)
                    else:
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=b)
                        o = fn()
                    out["cudnn"] = (bench(fn), (o.float() - ref).abs().max().item())
            except Exception as e:
                out["cudnn"] = (None, repr(e)[:200])
            for chunk in (32, 64, 128, 256, 512):
                for warps in (1, 2, 4, 8):
                    try:
                        fn = lambda: fused.decode_attention(q, k, v, b, chunk=chunk, warps=warps)
                        o = fn(); err = (o.float() - ref).abs().max().item()
                        out[f"t{chunk}w{warps}"] = (bench(fn), err)
                    except Exception as e:
                        out[f"t{chunk}w{warps}"] = (None, repr(e)[:300])
            bound = R * L * KV * D * 2 * 2 / bw * 1e6
            best = min((v_[0], k_) for k_, v_ in out.items() if v_[0] is not None and k_ != "cudnn")
            print(f"{shape} L={L} bound {bound:.1f}us cudnn {out['cudnn'][0]:.1f}us best {best[1]} {best[0]:.1f}us | " +
                  ", ".join(f"{k_}={v_[0]:.1f}" if v_[0] is not None else f"{k_}=ERR {v_[1]}" for k_, v_ in out.items()),
                  flush=True)
            print(f"   max err: " + ", ".join(f"{k_}={v_[1]:.1e}" for k_, v_ in out.items() if v_[0] is not None), flush=True)
            RES[f"attn_{shape}_L{L}"] = dict(bound=bound, **out)


@section("topk")
def _():
    for R in (64, 256):
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(R, 50304, device=dev, dtype=dtype)
            want = logits.topk(50).indices.sort(-1).values
            row = {"sorted": bench(lambda: logits.topk(50)), "unsorted": bench(lambda: logits.topk(50, sorted=False))}
            for block in (32, 64, 128):
                got = generate.top_candidates(logits, 50, block)[1].sort(-1).values
                row[f"blocks_{block}"] = bench(lambda: generate.top_candidates(logits, 50, block))
                row[f"blocks_{block}_same_set"] = bool(torch.equal(got, want))
            print(f"topk R={R} {dtype}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            RES[f"topk_R{R}_{dtype}"] = row


@section("step")
def _():
    from model import ModelConfig, Transformer
    LLAMA = dict(vocab_size=50304, pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False,
                 tie_embeddings=False, dropout=0.0, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**LLAMA)).to(dev, dt)
    x = torch.randint(0, 50304, (64, 64), device=dev)
    blocks = generate.top_candidates
    plain = lambda logits, k, block=64: logits.topk(k, dim=-1)  # the shipped (sorted, one round) call
    configs = [("shipped", plain, dict(attention="sdpa"), None), ("blocks", blocks, dict(attention="sdpa"), None),
               ("blocks+triton", blocks, {}, None), ("blocks+triton+bucket32", blocks, dict(bucket=32), None)]
    for label, topk, kw, dflt in configs:
        generate.top_candidates = topk
        if dflt:
            fused.decode_attention.__defaults__ = dflt
        torch._dynamo.reset()
        keep = {}
        t0 = time.time()
        generate.decode(model, x, 256, temperature=1.0, top_k=50, seed=0, compile=True, keep=keep, **kw)
        torch.cuda.synchronize(); t1 = time.time()
        times = []
        for _ in range(3):
            t = time.perf_counter(); generate.decode(model, x, 256, temperature=1.0, top_k=50, seed=0, compile=True, keep=keep, **kw)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        dec = next(iter(keep.values()))
        per = {}
        for span, replay in sorted(dec.graphs.items()):
            dec.cache.span = span
            dec.index.fill_(span - 60); dec.first.fill_(span - 65)  # replays advance the slot: stay inside the cache and the output
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(50):
                replay()
            e1.record(); torch.cuda.synchronize()
            per[span] = e0.elapsed_time(e1) * 1000 / 50
        tok = [64 * 256 / t for t in times]
        print(f"step[{label}] first call {t1-t0:.1f}s, calls {[round(t*1000,1) for t in times]} ms = {[round(v) for v in tok]} tok/s;"
              f" us/step by bucket {{ {', '.join(f'{k}: {v:.0f}' for k, v in per.items())} }}", flush=True)
        RES[f"step_{label}"] = dict(calls_ms=[t * 1000 for t in times], tok_s=tok, us_per_step=per)
        del keep, dec
    generate.top_candidates = blocks
