"""Memory on a 24 GiB card: each training step's measured peak and tokens/s next to plan.py's prediction,
ingot and HF transformers + peft on the same shapes, in one call.

    python bench/bench_memory.py lora8b qlora8b hf8b --cap_gib=24 --json=bench/results/memory/8b.json
    python bench/bench_memory.py full1b pretrain1b ladder hf1b --cap_gib=24 --json=bench/results/memory/1b.json
    python bench/bench_memory.py all --tiny          # CPU smoke test: tiny shapes, nothing measured but speed

Each row runs in a child process of its own, capped with torch.cuda.set_per_process_memory_fraction
(cap_gib of the GPU's memory; an OOM is a result), one GPU, bf16 autocast, random tokens, 2 x 2048
tokens per step (torchtune's batch 2, packed 2048). The model is built by materialize.build in its
storage dtype (the LoRA bases in bf16; QLoRA's linears on the host until quantised). After --warmup
steps, torch.cuda.reset_peak_memory_stats(); the peak is max_memory_allocated over the --steps timed
steps (weights and optimizer state included, what plan.predict predicts; the CUDA context is not).
Then one more step measured by phases (phases_gib: allocated before it, each of forward, backward and
the optimizer step's peak and what it leaves), where the plan's terms can be told apart.

Cases (rows): lora8b: Llama-3-8B shape, LoRA r=16 on all linears, bf16 base: as is, + chunked loss, +
whole-block checkpointing. qlora8b: the same on an NF4 base (double quantisation). lean8b: both
checkpointed, the residual stream in bf16 (chunk8b: with 256-token loss chunks); offload8b: the blocks'
inputs in host memory; host8b: and the frozen token embedding too. full1b: Llama-3.2-1B shape, full
fine-tuning (AdamW) with plan.fit's knobs for cap_gib; pretrain1b: Muon with plan.fit's knobs; ladder:
the 1B fine-tune with each knob added in turn (torchtune's ladder); parts1b: pretrain1b with and
without the chunked loss. hf8b / hf1b (hfq8b: its QLoRA row): transformers' LlamaForCausalLM (sdpa) +
peft LoRA (bitsandbytes 4-bit where installed) / full fine-tuning, with and without checkpointing.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config  # noqa: E402
import lifecycle  # noqa: E402
import parallel  # noqa: E402
import plan  # noqa: E402
from memory import materialize  # noqa: E402
from model import ModelConfig  # noqa: E402

SHAPES = {
    "8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336, block_size=2048,
               rope_theta=500000.0, tie_embeddings=False),
    "1b": dict(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192, block_size=2048,
               rope_theta=500000.0, tie_embeddings=True),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=192, block_size=64),
}
LORA = dict(lora_r=16, lora_alpha=32.0, lora_base_dtype="bfloat16")
CK = dict(grad_checkpoint=True)
CHUNK = dict(loss_chunk=1024)
LEAN, OFF, HOST = dict(fp32_residual=False), dict(offload_activations=True), dict(embed_on_host=True)
INB = dict(optimizer_in_backward=True, grad_clip=0.0)
CASES = {  # case -> [(row, shape, knobs)]; "fit" rows take plan.fit's knobs for cap_gib
    "lora8b": [("lora8b", "8b", LORA), ("lora8b+chunk", "8b", {**LORA, **CHUNK}),
               ("lora8b+chunk+ckpt", "8b", {**LORA, **CHUNK, **CK})],
    "qlora8b": [("qlora8b+chunk+ckpt", "8b", {**LORA, **CHUNK, **CK, "lora_base_dtype": "nf4"}),
                ("qlora8b+chunk", "8b", {**LORA, **CHUNK, "lora_base_dtype": "nf4"})],
    "full1b": [("full1b fit", "1b", dict(fit=True))],
    "pretrain1b": [("pretrain1b muon fit", "1b", dict(optimizer="muon", fit=True))],
    "ladder": [("1b full", "1b", {}), ("+ chunked loss", "1b", CHUNK),
               ("+ bf16 residual", "1b", {**CHUNK, "fp32_residual": False}),
               ("+ recompute mlp", "1b", {**CHUNK, "fp32_residual": False, "recompute": "mlp"}),
               ("+ recompute blocks", "1b", {**CHUNK, "fp32_residual": False, **CK}),
               ("+ optimizer in backward", "1b", {**CHUNK, "fp32_residual": False, **CK, **INB}),
               ("+ 8-bit AdamW", "1b", {**CHUNK, "fp32_residual": False, **CK, "adamw_state": "8bit"}),
               ("offloaded AdamW instead", "1b", {**CHUNK, "fp32_residual": False, **CK, "adamw_state": "offload"})],
    "lean8b": [("lora8b+chunk+ckpt, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN}),
               ("qlora8b+chunk+ckpt, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, "lora_base_dtype": "nf4"})],
    "chunk8b": [("lora8b+chunk 256+ckpt, bf16 residual", "8b", {**LORA, "loss_chunk": 256, **CK, **LEAN})],
    "offload8b": [("lora8b+chunk+ckpt+offload, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF}),
                  ("the same, 1 x 2048 tokens", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF, "micro_batch_size": 1}),
                  ("qlora8b+chunk+ckpt+offload, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF,
                                                                      "lora_base_dtype": "nf4"})],
    "host8b": [("lora8b+chunk+ckpt+offload+embed on host, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF, **HOST}),
               ("the same, 1 x 2048 tokens", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF, **HOST, "micro_batch_size": 1}),
               ("lora8b+chunk+ckpt+embed on host, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, **HOST}),
               ("qlora8b+chunk+ckpt+offload+embed on host, bf16 residual", "8b", {**LORA, **CHUNK, **CK, **LEAN, **OFF,
                                                                                 **HOST, "lora_base_dtype": "nf4"})],
    "hf8b": [("hf lora8b", "8b", dict(hf=True, **LORA)), ("hf lora8b+ckpt", "8b", dict(hf=True, **LORA, **CK)),
             ("hf qlora8b+ckpt", "8b", {"hf": True, **LORA, **CK, "lora_base_dtype": "nf4"}),
             ("hf qlora8b+ckpt, 1 x 2048", "8b", {"hf": True, **LORA, **CK, "micro_batch_size": 1, "lora_base_dtype": "nf4"})],
    "hf1b": [("hf full1b", "1b", dict(hf=True)), ("hf full1b+ckpt", "1b", dict(hf=True, **CK))],
}
CASES["parts1b"] = CASES["pretrain1b"] + [("pretrain1b muon + chunked loss", "1b", dict(optimizer="muon", **CHUNK))]
CASES["ladder8"] = CASES["ladder"][6:7]  # the 8-bit AdamW row alone
CASES["nofit1b"] = CASES["ladder"][:3]  # the rows over 24 GiB: their peaks with --cap_gib=0 (no cap)
CASES["hfq8b"] = CASES["hf8b"][2:]


def make_cfg(shape, knobs, args):
    d = {**config.defaults(lifecycle.TRAIN), **SHAPES[shape], "micro_batch_size": args.batch, "batch_size": args.batch,
         "seq_len": 0, "dtype": "bfloat16", "device": args.device,
         "lr": 1e-5, "warmup_steps": 0, "weight_decay": 0.0}
    d.update({k: v for k, v in knobs.items() if k not in ("fit", "hf")})
    if args.tiny:
        d.update(block_size=64)
    return argparse.Namespace(**d)


def fitted(cfg, args):
    """plan.fit's knobs for cap_gib applied to cfg (the cfg itself when it fits)."""
    steps = plan.fit(cfg, args.cap_gib)
    return (steps[-1][1], [k for k, _, _ in steps]) if steps else (cfg, [])


def ours(cfg):
    """(step function, device) for our model under cfg on one device: built as weights.build_model builds
    a LoRA run from init_from (materialize.build; random weights here, init=True), laid out by
    parallel.parallelize (chunked loss, LoRA / NF4, recompute, the optimizer, DataParallel), stepped as a
    stage steps (net.backward, net.step)."""
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    # QLoRA's base is drawn on the GPU in bf16 and quantised there (a stage keeps it on the host until
    # quantised: materialize.build's linear_device; built on the host, two rows did not finish in 420 s): the peak
    # measured is the step's, after reset_peak_memory_stats, either way
    model = materialize.build(ModelConfig.from_cfg(cfg), grid.device, materialize.storage_dtype(cfg), init=True)
    net = parallel.parallelize(model, grid, cfg)
    autocast = parallel.autocast(cfg, grid.device)

    def step(x, y, mark=lambda phase: None):
        with autocast:
            loss = net(x, y)
        mark("forward")
        net.backward(loss)
        mark("backward")
        net.step(1.0)
        mark("step")
        return loss.detach()
    return step, grid.device


def theirs(cfg):
    """(step, device) for transformers' LlamaForCausalLM of the same shape (+ peft LoRA / bnb 4-bit)."""
    import transformers
    dev = torch.device(cfg.device)
    m = ModelConfig.from_cfg(cfg)
    hc = transformers.LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=m.hidden,
                                  num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
                                  num_key_value_heads=m.kv_heads, max_position_embeddings=m.block_size,
                                  rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings)
    dtype = torch.bfloat16 if cfg.lora_r else torch.float32
    torch.manual_seed(0)
    if cfg.lora_r and cfg.lora_base_dtype == "nf4":
        __import__("bitsandbytes")  # ImportError: the row is skipped
        import tempfile
        folder = tempfile.mkdtemp()  # random bf16 weights, saved, then loaded quantised (bitsandbytes quantises on load)
        with torch.device(dev):
            src = hf_from_config(transformers, hc, torch.bfloat16)
        src.save_pretrained(folder)
        del src  # the bf16 source off the GPU before the quantised load (a model holds reference cycles)
        gc.collect()
        torch.cuda.empty_cache()
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=q, device_map={"": dev.index or 0},
                                                              attn_implementation="sdpa")
    else:
        with torch.device(dev):
            model = hf_from_config(transformers, hc, dtype)
    if cfg.grad_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r:
        import peft
        if cfg.grad_checkpoint:
            model.enable_input_require_grads()
        model = peft.get_peft_model(model, peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                           target_modules="all-linear", lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, fused=dev.type == "cuda")
    autocast = torch.autocast(dev.type, torch.bfloat16, enabled=cfg.dtype == "bfloat16")

    def step(x, y, mark=lambda phase: None):
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        mark("forward")
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("step")
        return loss.detach()
    return step, dev


def hf_from_config(transformers, hc, dtype):
    try:  # transformers >= 4.56 names it dtype, older ones torch_dtype
        return transformers.LlamaForCausalLM._from_config(hc, dtype=dtype, attn_implementation="sdpa")
    except TypeError:
        return transformers.LlamaForCausalLM._from_config(hc, torch_dtype=dtype, attn_implementation="sdpa")


def child(row, shape, knobs, args):
    """One row, measured in this process -> dict."""
    cuda = args.device == "cuda"
    if cuda and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    cfg = make_cfg(shape, knobs, args)
    out = {"row": row, "shape": shape, "tokens_per_step": args.batch * cfg.block_size}
    fit_knobs = []
    if knobs.get("fit"):
        cfg, fit_knobs = fitted(cfg, args)
        out["plan_fit_knobs"] = fit_knobs
    if not knobs.get("hf"):
        out["predicted_gib"] = round(plan.predict(cfg)["total"] / 2**30, 3)
    out["knobs"] = {k: getattr(cfg, k) for k in ("lora_r", "lora_base_dtype", "loss_chunk", "grad_checkpoint", "recompute",
                                                 "fp32_residual", "adamw_state", "optimizer", "micro_batch_size",
                                                 "offload_activations", "optimizer_in_backward", "embed_on_host")}
    phase = "building the model"
    try:
        step, dev = theirs(cfg) if knobs.get("hf") else ours(cfg)
        phase = "training"
        if cuda:
            out["built_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        g = torch.Generator().manual_seed(0)
        T, B = cfg.block_size, cfg.micro_batch_size
        x = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev)
        y = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(dev)
        for _ in range(args.warmup):
            step(x, y)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step(x, y)
        loss = loss.item()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out.update(loss=loss, tokens_per_s=round(args.steps * B * T / dt, 1))
        out["tokens_per_step"] = B * T
        if cuda:
            out["measured_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            if "predicted_gib" in out:
                out["error_pct"] = round(100 * (out["predicted_gib"] / out["measured_gib"] - 1), 1)
            out["phases_gib"] = phases(step, x, y)
    except torch.OutOfMemoryError as e:
        out["oom"] = f"out of memory under the {args.cap_gib:g} GiB cap, {phase}"
        out["oom_detail"] = " ".join(str(e).split())[:400]  # the allocation asked for, what was held
        out["peak_before_oom_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    except ImportError as e:
        out["skipped"] = f"needs {e.name}"
    return out


def phases(step, x, y):
    """One more step, measured by parts: memory allocated before it, then each phase's (forward, backward,
    optimizer step) peak and what it leaves allocated, in GiB (where a plan's terms can be told apart)."""
    torch.cuda.synchronize()
    out = {"before": round(torch.cuda.memory_allocated() / 2**30, 3)}
    torch.cuda.reset_peak_memory_stats()

    def mark(phase):
        torch.cuda.synchronize()
        out[phase] = {"peak": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                      "after": round(torch.cuda.memory_allocated() / 2**30, 3)}
        torch.cuda.reset_peak_memory_stats()
    step(x, y, mark)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", default=["all"], help=f"{', '.join(CASES)} or all")
    p.add_argument("--cap_gib", type=float, default=24.0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    p.add_argument("--json", default="")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.child:
        case, i = args.child.rsplit(":", 1)
        row, shape, knobs = CASES[case][int(i)]
        print("RESULT " + json.dumps(child(row, "tiny" if args.tiny else shape, knobs, args)), flush=True)
        return
    names = list(CASES) if args.cases == ["all"] else args.cases
    bad = [c for c in names if c not in CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {bad}: choose from {', '.join(CASES)} or all")
    rows = []
    for case in names:
        for i in range(len(CASES[case])):
            cmd = [sys.executable, os.path.abspath(__file__), f"--child={case}:{i}"] + [a for a in sys.argv[1:]
                                                                                      if a.startswith("--") and not a.startswith("--json")]
            res = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
            r = json.loads(line[7:]) if line else {"row": CASES[case][i][0], "error": (res.stderr or res.stdout)[-800:]}
            rows.append(r)
            print(fmt(r), flush=True)
    rep = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "cap_gib": args.cap_gib,
           "torch": torch.__version__, "commit": commit(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)


def fmt(r):
    what = r.get("oom") or r.get("skipped") or "".join(r.get("error", "").strip().splitlines()[-1:])
    if "tokens_per_s" in r:
        meas = f"{r['measured_gib']:.2f} GiB" if "measured_gib" in r else "n/a (CPU)"
        what = f"measured {meas} | predicted {r.get('predicted_gib', 'n/a')} GiB | {r['tokens_per_s']:.0f} tok/s"
    knobs = f" [plan.fit: {', '.join(r['plan_fit_knobs']) or 'nothing needed'}]" if "plan_fit_knobs" in r else ""
    return f"| {r['row']:<26} | {what}{knobs}"


def commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
