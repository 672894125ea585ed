"""Debug: compiled TP vs eager TP on CUDA (losses per step; grads after step 1)."""
import os, sys, torch
sys.path.insert(0, os.getcwd())
from types import SimpleNamespace
import parallel, tp, optim
from model import ModelConfig, Transformer
grid = parallel.init(SimpleNamespace(device="cuda", tp=2, ep=1))
dev = grid.device
shape = dict(vocab_size=8192, block_size=512, n_layer=4, n_embd=512, n_head=8, n_kv_head=4, activation="swiglu", norm="rmsnorm", pos_emb="rope")
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator(device=dev).manual_seed(1)
data = [torch.randint(0, 8192, (4, 513), device=dev, generator=g) for _ in range(3)]
say = print if grid.rank == 0 else (lambda *a: None)
def run(backend, ac, fused, sp=False, steps=8):
    torch._dynamo.reset(); torch.manual_seed(0)
    with torch.device(dev):
        raw = Transformer(ModelConfig(**shape))
    tp.tensor_parallel(raw, grid, sequence_parallel=sp)
    fwd = torch.compile(raw, backend=backend) if backend else raw
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-3, fused=fused)
    ls, grads = [], None
    for i in range(steps):
        d = data[i % 3]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
            loss = fwd(d[:, :-1], d[:, 1:])
        loss.backward()
        if i == 0:
            grads = {n: p.grad.detach().float().clone() for n, p in raw.named_parameters()}
        opt.step(); opt.zero_grad(set_to_none=True); ls.append(round(loss.item(), 4))
    return ls, grads
for ac in (False, True):
    for sp in (False, True):
        e, ge = run(None, ac, True, sp)
        say(f"ac={ac} sp={sp} eager      {e}")
        for backend, fused in (("inductor", True), ("inductor", False), ("aot_eager", True)):
            c, gc = run(backend, ac, fused, sp)
            worst = sorted(((gc[n] - ge[n]).norm().item() / max(ge[n].norm().item(), 1e-12), n) for n in ge)[-3:]
            say(f"ac={ac} sp={sp} {backend:9s} fused={fused} {c}  worst grad rel err {[(round(a, 4), n) for a, n in worst]}")
parallel.shutdown()
