"""Decode-step micro benchmarks on the GPU: attention kernels, M=64 matmuls, the captured step per bucket."""
import os, sys, time, traceback, json
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

dev, dt = "cuda", torch.bfloat16
RES = {}


def bench(fn, iters=100, reps=12):
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
        try:
            t = time.time(); f(); print(f"[{name}] {time.time()-t:.1f}s", flush=True)
        except Exception:
            traceback.print_exc()
        return f
    return deco


x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
bw = 2 * x.numel() / (bench(lambda: y.copy_(x)) * 1e-6)
print(f"copy bandwidth {bw/1e12:.2f} TB/s"); del x, y
R, H, KV, D, S = 64, 12, 12, 64, 320
print("fa schema:", torch.ops.aten._flash_attention_forward.default._schema)


@section("attention")
def _():
    g = torch.Generator(dev).manual_seed(0)
    kbuf = torch.randn(R, KV, S, D, device=dev, dtype=dt, generator=g)
    vbuf = torch.randn(R, KV, S, D, device=dev, dtype=dt, generator=g)
    ktok = kbuf.transpose(1, 2).contiguous(); vtok = vbuf.transpose(1, 2).contiguous()  # (R, S, KV, D)
    q = torch.randn(R, H, 1, D, device=dev, dtype=dt, generator=g)
    pad = torch.randint(0, 12, (R,), device=dev, generator=g)
    for L in (128, 192, 256, 320):
        index = L - 10  # slots < index+1 filled
        j = torch.arange(S, device=dev)
        keep = (j[None] >= pad[:, None]) & (j[None] <= index)
        bias = torch.zeros(R, S, device=dev, dtype=dt).masked_fill_(~keep, float("-inf"))
        k, v, b = kbuf[:, :, :L], vbuf[:, :, :L], bias[:, None, None, :L]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=b.float())
        out = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=b)
                    o = fn(); err = (o.float() - ref).abs().max().item()
                    out[name] = (bench(fn), err)
            except Exception as e:
                out[name] = (None, repr(e)[:200])
        qv = q[:, :, 0].contiguous()  # (R, H, D)
        cu_q = torch.arange(R + 1, device=dev, dtype=torch.int32)
        cu_k = torch.cat([torch.arange(R, device=dev) * S + pad, torch.tensor([R * S], device=dev)]).int()
        used = (index + 1 - pad).int()
        kf, vf = ktok.view(R * S, KV, D), vtok.view(R * S, KV, D)
        for ns in (None,):
            try:
                kw = dict(seqused_k=used) if ns is None else dict(seqused_k=used, num_splits=ns)
                fn = lambda: torch.ops.aten._flash_attention_forward(qv, kf, vf, cu_q, cu_k, 1, L, 0.0, False, False, **kw)[0]
                o = fn(); err = (o.float().view(R, H, 1, D) - ref).abs().max().item()
                out[f"fa2varlen_s{ns}"] = (bench(fn), err)
            except Exception as e:
                out[f"fa2varlen_s{ns}"] = (None, repr(e)[:300])
        import fused
        for chunk in (32, 64, 128):
            for warps in (2, 4):
                try:
                    fn = lambda: fused.decode_attention(q, k, v, b, chunk=chunk, warps=warps)
                    o = fn(); err = (o.float() - ref).abs().max().item()
                    out[f"split{chunk}w{warps}"] = (bench(fn), err)
                except Exception as e:
                    out[f"split{chunk}w{warps}"] = (None, repr(e)[:300])
        try:
            from torch.nn.attention.flex_attention import flex_attention
            bb = bias[:, :L]
            fl = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, bi, h, i, jj: s + bb[bi, jj]))
            fn = lambda: fl(q, k, v)
            o = fn(); err = (o.float() - ref).abs().max().item()
            out["flex"] = (bench(fn), err)
        except Exception as e:
            out["flex"] = (None, repr(e)[:200])
        bound = R * L * KV * D * 2 * 2 / bw * 1e6
        print(f"L={L} bound {bound:.1f}us: " + ", ".join(f"{k_}={v_[0] if v_[0] is None else round(v_[0],1)}us(err {v_[1] if isinstance(v_[1],str) else round(v_[1],4)})" for k_, v_ in out.items()), flush=True)
        RES[f"attn_L{L}"] = dict(bound=bound, **{k_: v_ for k_, v_ in out.items()})


@section("matmul") if os.environ.get("MM") else (lambda f: f)
def _():
    x = torch.randn(64, 768, device=dev, dtype=dt); x2 = torch.randn(64, 2048, device=dev, dtype=dt)
    for name, (inp, n) in {"qkv": (x, 2304), "o": (x, 768), "gateup": (x, 4096), "down": (x2, 768), "head": (x, 50304)}.items():
        w = torch.randn(n, inp.shape[1], device=dev, dtype=dt) * 0.02
        row = {"cublas": bench(lambda: F.linear(inp, w)), "bound": w.numel() * 2 / bw * 1e6}
        for mode in ("default", "max-autotune-no-cudagraphs"):
            try:
                torch._dynamo.reset()
                f = torch.compile(lambda a, b: F.linear(a, b), mode=None if mode == "default" else mode)
                f(inp, w)
                row[mode] = bench(lambda: f(inp, w))
            except Exception as e:
                row[mode] = repr(e)[:200]
        print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        RES[f"mm_{name}"] = row


@section("step")
def _():
    import generate
    from model import ModelConfig, Transformer
    LLAMA = dict(vocab_size=50304, pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False,
                 tie_embeddings=False, dropout=0.0, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**LLAMA)).to(dev, dt)
    x = torch.randint(0, 50304, (64, 64), device=dev)
    import fused
    for label, comp, att, dflt in (("default", True, None, None), ("split64w4", True, "split", (64, 4)),
                                   ("split32w4", True, "split", (32, 4)), ("split64w2", True, "split", (64, 2)),
                                   ("split128w4", True, "split", (128, 4))):
        if dflt:
            fused.decode_attention.__defaults__ = dflt
        torch._dynamo.reset()
        t = time.perf_counter(); generate.decode(model, x, 1, temperature=1.0, top_k=50, seed=0); torch.cuda.synchronize()
        t = time.perf_counter(); generate.decode(model, x, 1, temperature=1.0, top_k=50, seed=0); torch.cuda.synchronize()
        RES[f"one_token_{label}"] = time.perf_counter() - t
        print(f"one-token call (prefill + setup) {RES[f'one_token_{label}']*1000:.1f} ms", flush=True)
        keep = {}
        t0 = time.time()
        generate.decode(model, x, 256, temperature=1.0, top_k=50, seed=0, compile=comp, keep=keep, attention=att)
        torch.cuda.synchronize(); t1 = time.time()
        times = []
        for _ in range(3):
            t = time.perf_counter(); generate.decode(model, x, 256, temperature=1.0, top_k=50, seed=0, compile=comp, keep=keep, attention=att)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        dec = next(iter(keep.values()))
        per = {}
        for span, replay in sorted(dec.graphs.items()):
            dec.cache.span = span
            dec.index.fill_(span - 60); dec.first.fill_(63)  # replays advance the slot: stay inside the cache
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


os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(RES, open(os.path.join(os.environ.get("OUT", "/tmp"), "micro.json"), "w"), indent=1, default=str)
