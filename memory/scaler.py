"""fp16 training: dynamic loss scaling, the same on every rank.

    scaler = LossScaler(device=grid.device)                 # scale 2^16, x2 after 2000 clean steps, /2 on overflow
    scaler.scale(loss / accum).backward()                   # every micro-step
    wrapper.finish()                                        # gradients reduced (DP / ZeRO-1 / FSDP)
    overflow = scaler.unscale_(scaler.grads(wrapper))       # collective: True on every rank if any rank overflowed
    if not overflow:
        clip, optimizer.step()
    scaler.update(overflow); wrapper.zero_grad()
    trainer.pt: scaler.state_dict() / scaler.load_state_dict(d)

A stage never calls it: parallelize gives the Net a LossScaler when the compute dtype is fp16, and
net.backward(loss) / net.step(max_norm) do the above; lifecycle.save / resume keep its state.

Why: fp16 holds magnitudes down to 6e-8 (subnormal) and up to 65504. Small activation gradients
underflow to zero in fp16 backward, so the loss is multiplied by a large scale first and the
(fp32) parameter gradients are divided by it afterwards. Too large a scale overflows to inf/NaN:
that step is skipped and the scale halved; after growth_interval clean steps it doubles again
(torch.amp.GradScaler's rule, state and defaults; tests/test_scaler.py checks the same
trajectory). The overflow flag is all-reduced (MAX) over `group` (default: every rank), because
under ZeRO-1, FSDP or TP each rank sees only its own gradients: one rank's inf must skip the step
everywhere, or the replicas drift apart. Unscaling happens before clipping, so grad_clip keeps
its meaning. bf16 needs none of this (fp32's exponent range): the scaler is for GPUs without bf16
(V100, T4, RTX 20xx). fp16_refusals(cfg) names the settings that cannot run in fp16.
"""
import torch
import torch.distributed as dist

import config
from parallelism import fsdp


class LossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 group=None, device=None):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1")
        self.scale_value, self.growth_tracker = float(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group, self.device = group, device  # device: the flag's, for a rank without gradients (NCCL: CUDA)

    def scale(self, loss):
        return loss * self.scale_value

    @staticmethod
    def grads(model):
        """This rank's gradients under any layout: an fsdp.FSDP's flat shard gradients, or every
        parameter's .grad (DataParallel: replicas; ZeRO-1: the owned ones, the rest are None)."""
        if isinstance(model, fsdp.FSDP):
            return [u.grad for u in model.units if u.grad is not None]
        return [p.grad for p in model.parameters() if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, grads):
        """Divide the gradients by the scale, in place; True when any of them, on any rank of the
        group, holds an inf or NaN (then skip this step). Collective: every rank calls it each step."""
        flag = torch.zeros((), device=grads[0].device if grads else (self.device or "cpu"))
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_value)
            total = torch.stack(torch._foreach_norm(grads)).float().sum()  # inf / NaN if any element is
            flag = (~torch.isfinite(total)).float()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def update(self, overflow):
        """After the step (taken or skipped): back off on overflow, grow after growth_interval clean steps."""
        if overflow:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self):
        return {"scale": self.scale_value, "growth_tracker": self.growth_tracker, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, state):
        self.scale_value, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]


def fp16_refusals(cfg, dtype=None):
    """Raise config.ConfigError for settings that cannot train under fp16 autocast. dtype: the compute
    dtype's name (parallel.amp_dtype's; None: cfg.dtype, which may say 'auto')."""
    if (dtype or getattr(cfg, "dtype", "")) != "float16":
        return
    if getattr(cfg, "lora_r", 1) and getattr(cfg, "lora_base_dtype", "float32") == "bfloat16":
        raise config.ConfigError("dtype='float16' with lora_base_dtype='bfloat16': a bf16 base needs bf16 autocast; "
                                 "set lora_base_dtype='float32' (or use a 4-bit base: lora_base_dtype='nf4')")
    if getattr(cfg, "grad_reduce_dtype", "float32") == "bfloat16":
        raise config.ConfigError("dtype='float16' with grad_reduce_dtype='bfloat16': a GPU without bf16 cannot "
                                 "reduce in it; set grad_reduce_dtype='float32'")
