"""AdamW with less on the GPU: 8-bit block-wise state (AdamW8bit), state and master weights in CPU
memory with the update on the CPU (OffloadAdamW), or each update fused into backward so that the
gradients never all exist at once (InBackwardAdamW). All are torch AdamW in every other respect.

    opt = optim_memory.build("8bit" | "offload", optim.param_groups(model, wd), lr, betas, eps)  # DP, one GPU
    muon.Muon(groups, ..., zero1=True, adamw=optim_memory.factory("8bit"))    # ZeRO-1: each owner's AdamW part
    optim_memory.build("8bit", optim.param_groups(wrapper, wd), ..., wrapper=wrapper)   # FSDP's flat shards

AdamW8bit (bitsandbytes' block-wise 8-bit Adam, Dettmers et al. 2022): each moment is quant.py's
uint8 codes (same shape as the parameter) plus one fp32 absmax per block of 256 elements; m uses
the signed dynamic code book, v the unsigned one. A step dequantises a slice of 2^20 elements
(2^22 on a GPU, where torch.compile fuses the slice into one pass), runs torch AdamW's
single-tensor formulas on it in fp32 and quantises the new moments back (quant.bins: a table, no
search); parameters under min_8bit_size elements (norms, biases) step exactly as torch.optim.AdamW.

OffloadAdamW (ZeRO-Offload's idea): exp_avg, exp_avg_sq and an fp32 master copy of every parameter
live in (pinned) CPU memory, updated there by torch's own AdamW (functional, foreach). step() copies
the gradients to the host bucket by bucket on a side stream, updates each bucket once it has landed
and copies the new parameters back on a second stream: transfers overlap the CPU's arithmetic.

Layouts: state for the tensors given, so DP, ZeRO-1 (muon's `adamw=`) and FSDP (flat shards) work unchanged.
Checkpoints: full_optim_state() gives torch AdamW's layout-free form {name: {step, exp_avg,
exp_avg_sq}} (dequantised / from the host), so a run resumes under any layout or optimizer;
load_state_dict() accepts that form (re-quantised: the same codes and, to rounding, the same
absmax, quant.requantize) or state_dict()'s own, which round-trips bitwise.
"""
import types

import torch
from torch.optim.adamw import adamw as torch_adamw

from config import need
from memory import quant
from parallelism import fsdp, tp

OPTIM_MEMORY_DEFAULTS = dict(  # the optimizer's memory: config keys
    adamw_state="fp32",      # fp32 | 8bit (block-wise 8-bit moments) | offload (state on the CPU): optim_memory.py
    optimizer_in_backward=False,  # each parameter updated as its gradient arrives, which is then freed (one GPU,
                                  # one micro-batch a step, grad_clip=0): optim_memory.InBackwardAdamW
)
RESUME_FREE = ("optimizer_in_backward",)  # a resumed run may change it (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    """adamw_state and optimizer_in_backward, and what they cannot work with."""
    inb = "optimizer_in_backward=True updates each parameter during backward"
    need(not cfg.optimizer_in_backward or world == 1, f"{inb}, before other ranks' gradients could be summed: one "
         f"process only (this run has {world})")
    need(not cfg.optimizer_in_backward or cfg.grad_clip == 0, f"{inb}, before the norm of all gradients exists: "
         f"set grad_clip=0 (now {cfg.grad_clip})")
    need(not cfg.optimizer_in_backward or cfg.batch_size <= cfg.micro_batch_size, f"{inb}: gradients cannot "
         f"accumulate over micro-batches; set micro_batch_size >= batch_size={cfg.batch_size}")
    need(not cfg.optimizer_in_backward or (cfg.optimizer == "adamw" and cfg.adamw_state == "fp32" and not cfg.zero1
                                           and cfg.data_parallel == "ddp" and cfg.dtype != "float16"
                                           and not cfg.grad_stats_every),
         f"{inb}: AdamW with fp32 state and data_parallel='ddp' only, not with fp16 loss scaling (which may skip "
         f"a step) or grad_stats_every (which reads the gradients)")
    need(cfg.adamw_state in ("fp32", "8bit", "offload"),
         f"adamw_state='{cfg.adamw_state}' must be fp32, 8bit or offload")
    need(not (cfg.adamw_state != "fp32" and cfg.optimizer == "muon" and cfg.data_parallel == "fsdp"),
         f"adamw_state='{cfg.adamw_state}' works under FSDP with optimizer='adamw' only (FSDP + Muon keeps fp32 "
         f"AdamW state): set adamw_state='fp32' or optimizer='adamw'")


STANDARD = ("step", "exp_avg", "exp_avg_sq")


def full_optim_state(opt, model, grid, wrapper=None):
    """{param name: torch AdamW's state, full tensors on CPU} for opt (with standard_state(p)), from a
    plain / DP / TP model, or an fsdp.FSDP wrapper's shards. Collective over TP (and FSDP's dp)."""
    if isinstance(wrapper, fsdp.FSDP):
        view = types.SimpleNamespace(state=_StandardView(opt), param_groups=opt.param_groups)
        return fsdp.full_optim_state(wrapper, view)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.standard_state(p).items():
                full = tp.full_tensor(p, v, grid) if torch.is_tensor(v) and v.shape == p.shape else v
                out.setdefault(names[id(p)], {})[k] = full.detach().cpu().clone() if torch.is_tensor(full) else full
    return out



def closure_loss(closure):
    """What an optimizer's step(closure) returns: the closure's loss, run with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class _StandardView:
    """optimizer.state as fsdp.full_optim_state reads it: p -> torch AdamW's entries."""

    def __init__(self, opt):
        self.opt = opt

    def get(self, p, default=None):
        st = self.opt.standard_state(p)
        return st if st else default


class _Base(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, eps, weight_decay, wrapper):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=False))
        self.wrapper = wrapper  # an fsdp.FSDP whose shards these are (checkpoints), or None

    def full_optim_state(self, model, grid):
        return full_optim_state(self, model, grid, self.wrapper)

    def load_state_dict(self, state_dict):
        """state_dict()'s own form, or torch AdamW's ({step, exp_avg, exp_avg_sq}, any device)."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            self.state[params[int(i)]] = dict(st)
            self.adopt(params[int(i)])

    def state_bytes(self, device=None):
        """Bytes of optimizer state (on `device` only, e.g. "cuda", when given)."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v) and (device is None or v.device.type == device))


# ----------------------------------------------------------------------------- 8-bit

class AdamW8bit(_Base):
    """AdamW with block-wise 8-bit moments (the module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, block=256,
                 min_8bit_size=4096, wrapper=None, chunk=None, compiled=None):
        super().__init__(params, lr, betas, eps, weight_decay, wrapper)
        self.block, self.min_8bit_size = block, min_8bit_size
        self.chunk = chunk  # elements per slice (whole blocks); None: 2^20 on the CPU, 2^22 on a GPU
        self.compiled = compiled  # None: torch.compile the slice update on a GPU (one fused pass), eager elsewhere
        self.fns = {}  # compiled or not -> the slice update
        self.codes = {}  # device -> (signed map for m, unsigned map for v)

    def code(self, device):
        """(signed book, unsigned book) on device, and their quant.bins tables (nearest code without a search)."""
        if device not in self.codes:
            books = (quant.dynamic_map(True), quant.dynamic_map(False))
            self.codes[device] = tuple(c.to(device) for c in books) + tuple(
                tuple(t.to(device) if torch.is_tensor(t) else t for t in quant.bins(c)) for c in books)
        return self.codes[device]

    def quantized(self, p):
        return p.numel() >= self.min_8bit_size

    def adopt(self, p):
        """Bring p's state into this optimizer's form: fresh zeros, or torch AdamW's entries
        (a checkpoint, muon.Muon.load_state_dict) quantised."""
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
        st["step"] = st["step"].detach().float().cpu().clone()
        if not self.quantized(p):
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].to(p.device, torch.float32) if k in st else torch.zeros_like(p, dtype=torch.float32)
            return st
        for k, code in zip(("exp_avg", "exp_avg_sq"), self.code(p.device)[:2]):
            if k in st:  # (requantize: values that were dequantised come back with their absmax)
                st[k + "_q"], st[k + "_absmax"] = quant.requantize(st.pop(k).to(p.device), code, self.block)
            elif k + "_q" not in st:
                st[k + "_q"], st[k + "_absmax"] = quant.quantize(torch.zeros(p.shape, device=p.device), code, self.block)
            else:
                st[k + "_q"], st[k + "_absmax"] = st[k + "_q"].to(p.device), st[k + "_absmax"].to(p.device)
        return st

    def standard_state(self, p):
        """torch AdamW's entries of p (fp32 on p's device; {} before the first step)."""
        st = self.state.get(p, {})
        if not st:
            return {}
        if "exp_avg" in st:
            return {k: st[k] for k in STANDARD}
        m, v = self.code(p.device)[:2]
        return {"step": st["step"],
                "exp_avg": quant.dequantize(st["exp_avg_q"], st["exp_avg_absmax"], m, self.block),
                "exp_avg_sq": quant.dequantize(st["exp_avg_sq_q"], st["exp_avg_sq_absmax"], v, self.block)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for g in self.param_groups:
            lr, wd, (b1, b2), eps = g["lr"], g["weight_decay"], g["betas"], g["eps"]
            small = [p for p in g["params"] if p.grad is not None and not self.quantized(p)]
            for p in g["params"]:
                st = self.state[p]
                if p.grad is not None and ("exp_avg_q" not in st if self.quantized(p) else "exp_avg" not in st):
                    self.adopt(p)  # first step, or torch AdamW's entries just loaded
            if small:  # torch's own AdamW, foreach over the small parameters: exactly torch.optim.AdamW
                sts = [self.state[p] for p in small]
                torch_adamw(small, [p.grad for p in small], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts],
                            [], [s["step"] for s in sts], foreach=True, amsgrad=False, beta1=b1, beta2=b2, lr=lr,
                            weight_decay=wd, eps=eps, maximize=False)
            for p in g["params"]:
                if p.grad is not None and self.quantized(p):
                    self.update_8bit(p, lr, wd, b1, b2, eps)
        return loss

    def update_8bit(self, p, lr, wd, b1, b2, eps):
        """torch AdamW's single-tensor formulas on dequantised slices of p's moments (slice_update)."""
        st, books, B = self.state[p], self.code(p.device), self.block
        st["step"] += 1
        step = st["step"].item()
        step_size, bc2_sqrt = lr / (1 - b1 ** step), (1 - b2 ** step) ** 0.5
        P, G = p.view(-1), p.grad.reshape(-1)
        mq, vq, ma, va = st["exp_avg_q"].view(-1), st["exp_avg_sq_q"].view(-1), st["exp_avg_absmax"], st["exp_avg_sq_absmax"]
        compiled = P.is_cuda if self.compiled is None else self.compiled
        if compiled not in self.fns:
            self.fns[compiled] = torch.compile(slice_update) if compiled else slice_update
        chunk = self.chunk or (1 << 22 if P.is_cuda else 1 << 20)
        chunk = max(B, chunk // B * B)
        # the step's numbers as one fp32 tensor: a compiled update takes new values without recompiling
        k = torch.tensor([1 - lr * wd, 1 - b1, b2, 1 - b2, bc2_sqrt, eps, step_size]).to(P.device)
        for a in range(0, P.numel(), chunk):
            b = min(a + chunk, P.numel())
            blocks = slice(a // B, -(-b // B))
            self.fns[compiled](P[a:b], G[a:b], mq[a:b], vq[a:b], ma[blocks], va[blocks], books, B, k)


def slice_update(x, g, mq, vq, ma, va, books, block, k):
    """One slice of AdamW8bit's step, in place: parameters x (fp32), gradient g, the moments' codes
    (mq, vq) and absmax (ma, va) dequantised, updated as torch AdamW does (k: 1 - lr wd, 1 - beta1,
    beta2, 1 - beta2, sqrt(bias correction 2), eps, lr / bias correction 1), quantised back. Plain
    tensor code: on a GPU torch.compile fuses it into a few kernels."""
    cm, cv, tm, tv = books
    m, v = quant.dequantize(mq, ma, cm, block), quant.dequantize(vq, va, cv, block)
    gr = g.float()
    x.mul_(k[0])
    m.lerp_(gr, k[1])
    v.mul_(k[2]).add_(gr * gr * k[3])
    x.sub_(m / (v.sqrt() / k[4] + k[5]) * k[6])
    for q, amax, new, code, table in ((mq, ma, m, cm, tm), (vq, va, v, cv, tv)):
        codes, scale = quant.quantize(new, code, block, table)
        q.copy_(codes)
        amax.copy_(scale)


# ----------------------------------------------------------------------------- CPU offload

class OffloadAdamW(_Base):
    """AdamW with its state and fp32 master weights in CPU memory, updated there (module docstring).
    bucket_mb: gradient bytes per transfer bucket (one group per bucket)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, bucket_mb=64.0,
                 wrapper=None):
        super().__init__(params, lr, betas, eps, weight_decay, wrapper)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.host = {}  # param -> (pinned fp32 master, pinned fp32 gradient buffer, pinned staging in p's dtype or None)
        self.streams = None  # (device-to-host, host-to-device) copy streams on CUDA

    def buffers(self, p):
        if p not in self.host:
            pin = p.is_cuda
            new = lambda dtype: torch.empty(p.shape, dtype=dtype, pin_memory=pin)  # noqa: E731
            master, grad = new(torch.float32), new(torch.float32)
            st = self.state.get(p, {})
            master.copy_(st.pop("master") if "master" in st else p.detach())
            self.host[p] = (master, grad, new(p.dtype) if p.dtype != torch.float32 else None)
        return self.host[p]

    def adopt(self, p):
        """State on the host: fresh zeros, or torch AdamW's entries moved there (a checkpoint; muon.Muon's
        load_state_dict puts them on the parameter's device). A saved master replaces the host copy."""
        st = self.state[p]
        if "master" in st:
            self.host.pop(p, None)
        master = self.buffers(p)[0]
        st["step"] = st["step"].detach().float().cpu().clone() if "step" in st else torch.tensor(0.0)
        for k in ("exp_avg", "exp_avg_sq"):
            t = torch.empty(master.shape, pin_memory=master.is_pinned())
            st[k] = t.copy_(st[k]) if k in st else t.zero_()
        return st

    def standard_state(self, p):
        st = self.state.get(p, {})
        if not st:
            return {}
        out = {k: st[k] if k == "step" else st[k].to(p.device) for k in STANDARD}
        if p.dtype != torch.float32:  # the master holds what the GPU copy rounds away
            out["master"] = self.buffers(p)[0].to(p.device)
        return out

    def load_state_dict(self, state_dict):
        self.host.clear()  # masters are taken again from the (just loaded) parameters, or a saved master
        super().load_state_dict(state_dict)

    def buckets(self):
        out = []
        for gi, g in enumerate(self.param_groups):
            cur, size = [], 0
            for p in g["params"]:
                if p.grad is None:
                    continue
                if cur and size + p.numel() * 4 > self.bucket_bytes:
                    out.append((gi, cur))
                    cur, size = [], 0
                cur.append(p)
                size += p.numel() * 4
            if cur:
                out.append((gi, cur))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        buckets = self.buckets()
        if not buckets:
            return loss
        cuda = buckets[0][1][0].is_cuda
        if cuda and self.streams is None:
            self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        for _, ps in buckets:
            for p in ps:
                if "exp_avg" not in self.state[p] or self.state[p]["exp_avg"].device.type != "cpu":
                    self.adopt(p)
        # every bucket's gradients start for the host at once, in order, on the copy stream
        events = []
        if cuda:
            d2h, h2d = self.streams
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                for _, ps in buckets:
                    for p in ps:
                        self.buffers(p)[1].copy_(p.grad, non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record()
        for i, (gi, ps) in enumerate(buckets):
            g = self.param_groups[gi]
            if cuda:
                events[i].synchronize()  # this bucket's gradients are on the host; later ones still moving
            else:
                for p in ps:
                    self.buffers(p)[1].copy_(p.grad)
            sts = [self.state[p] for p in ps]
            masters = [self.buffers(p)[0] for p in ps]
            torch_adamw(masters, [self.buffers(p)[1] for p in ps], [s["exp_avg"] for s in sts],
                        [s["exp_avg_sq"] for s in sts], [], [s["step"] for s in sts], foreach=True, amsgrad=False,
                        beta1=g["betas"][0], beta2=g["betas"][1], lr=g["lr"], weight_decay=g["weight_decay"],
                        eps=g["eps"], maximize=False)
            for p, master in zip(ps, masters):
                stage = self.buffers(p)[2]
                src = master if stage is None else stage.copy_(master)  # bf16 on the GPU: rounded on the host
                if cuda:
                    with torch.cuda.stream(h2d):
                        p.copy_(src, non_blocking=True)
                else:
                    p.copy_(src)
        if cuda:
            torch.cuda.current_stream().wait_stream(h2d)  # the next forward reads the new parameters
        return loss


# ----------------------------------------------------------------------------- the step fused into backward

class InBackwardAdamW(torch.optim.Optimizer):
    """torch AdamW with each parameter's update fused into backward (torchtune's optimizer_in_bwd): a
    post-accumulate-grad hook updates the parameter as soon as its gradient exists, then frees the
    gradient, so no moment of a step holds every gradient. One process, one micro-batch per step, no
    clipping (config.validate refuses the rest). param_groups, state, state_dict and load_state_dict are
    torch AdamW's (checkpoints resume either way); step() has nothing left to do; grad_norm() is the norm
    of the gradients the hooks saw since the last call. Bitwise torch.optim.AdamW(foreach=False) on CPU."""

    in_backward = True

    def __init__(self, groups, lr, betas, eps):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.sq, self.where = None, {}  # where: parameter -> its group's index (load_state_dict makes new groups)
        for i, g in enumerate(self.param_groups):
            for p in g["params"]:
                self.where[p] = i
                p.register_post_accumulate_grad_hook(self.update)

    @torch.no_grad()
    def update(self, p):
        g, st = self.param_groups[self.where[p]], self.state[p]
        if not st:  # torch AdamW's entries, as its first step makes them
            st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                      exp_avg_sq=torch.zeros_like(p))
        sq = p.grad.float().square().sum()
        self.sq = sq if self.sq is None else self.sq + sq
        torch_adamw([p], [p.grad], [st["exp_avg"]], [st["exp_avg_sq"]], [], [st["step"]], foreach=False,
                    amsgrad=False, beta1=g["betas"][0], beta2=g["betas"][1], lr=g["lr"],
                    weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)
        p.grad = None

    def step(self, closure=None):
        return closure_loss(closure)  # every update ran in backward

    def grad_norm(self):
        """The norm of the gradients since the last call (0 when none came)."""
        sq, self.sq = self.sq, None
        return torch.zeros(()) if sq is None else sq.sqrt()


def bytes_per_param(kind):
    """GPU bytes of AdamW state per trained parameter: 'fp32' 8, '8bit' 2 (+ 8 / 256 of absmax), 'offload' 0."""
    return {"fp32": 8.0, "8bit": 2.0 + 2 * 4 / 256, "offload": 0.0}[kind]


def build(kind, groups, lr, betas, eps, wrapper=None, in_backward=False):
    """The AdamW of kind 'fp32' (None: torch's, the caller builds it; in_backward: InBackwardAdamW), '8bit'
    or 'offload'."""
    if kind == "fp32":
        return InBackwardAdamW(groups, lr=lr, betas=betas, eps=eps) if in_backward else None
    if kind not in ("8bit", "offload"):
        raise ValueError(f"adamw_state='{kind}' must be fp32, 8bit or offload")
    cls = AdamW8bit if kind == "8bit" else OffloadAdamW
    return cls(groups, lr=lr, betas=betas, eps=eps, wrapper=wrapper)


def factory(kind):
    """muon.Muon's adamw= argument for kind (None for 'fp32': torch's AdamW)."""
    if kind == "fp32":
        return None
    return lambda groups, lr, betas, eps: build(kind, groups, lr, betas, eps)

