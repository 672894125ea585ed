"""GRPO: reinforcement learning with verifiable rewards, top to bottom.

    python grpo.py configs/grpo_tiny.py                                  # the arithmetic task on CPU
    torchrun --nproc_per_node=2 grpo.py configs/grpo_tiny.py --data_parallel=fsdp --init_from=out/sft_tiny

A step: P prompts -> G samples each from the fast decoder (with the rollout policy's log-probs) -> the
task's rewards -> advantages -> grpo_epochs optimizer steps on the rollout. The math, plain functions at
the top (tested against TRL's GRPOTrainer): advantages, policy_loss (the clipped surrogate per token or
per completion, grpo / dapo / dr_grpo normalisers, clip-higher) and k3 (the KL to a frozen initial copy,
when beta > 0), entropy_coeff's bonus. Log-probs are of logits / temperature; a completion's end of turn
is in its mask. mask_truncated drops completions cut at max_new_tokens, dynamic_sampling equal groups
(refill_rounds: DAPO's refill), filter_pass_rate prompts by the start's pass rate (posttrain/selection.py).
Layouts: each data rank rolls out a contiguous slice of the P x G, seeded by the step and its data rank
(rewards gathered before the advantages; TP ranks draw the same tokens; FSDP gathers once around the
rollout); normalisers are the step's global counts: DP / FSDP steps equal one process.
"""
import contextlib
import sys
from dataclasses import dataclass

import torch

import chat
import config
import generate
import lifecycle
import logs
import lora
import optim
import parallel
import weights
from model import IGNORE
from posttrain import diagnose, objectives, prompts, selection
from tools import gradstats

# ours, then TRL's cispo and sapo (objectives.py). Not bnpo: its per-micro-batch token mean depends on the layout
LOSS_TYPES, SCALES = ("grpo", "dapo", "dr_grpo", "cispo", "sapo"), ("group", "batch", "none")

DEFAULTS = dict(  # this stage's own config keys; batch_size counts completions per step
    task="arithmetic",        # tasks.get(name): prompts with answers and the reward that checks them
    task_args={},             # the task's settings, e.g. dict(max_operand=999, terms=3) (tasks.settings(name))
    prompt_data="",           # your prompts instead of a task: a file, folder or hf:<name> of GSM8K / MATH / prompt records
    eval_prompt_data="",      # held-out prompts from another source ("": eval_percent of prompt_data)
    eval_percent=5.0,         # share of prompt_data held out (by a hash of the prompt: never trained on)
    prompt_instruction="",    # appended to each prompt ("auto": the answer format's own instruction)
    reward="",                # "" (the task's; math on prompt_data) | math | strict | lenient | format | code | file.py:fn | "math,format:0.2"
    train_prompts=4096,       # task.train(n, seed): the prompts the steps cycle through
    eval_prompts=128,         # held-out prompts (reward sampled and greedy, strict and lenient accuracy)
    group_size=8,             # G samples per prompt: batch_size / G prompts per step
    max_new_tokens=32,        # longest completion (the end-of-turn token included)
    temperature=1.0,          # sampling; every log-prob is of logits / temperature
    top_k=0, top_p=1.0,       # sampling filters (0 / 1.0: off; the log-probs are of the unfiltered logits)
    grpo_epochs=1,            # mu: optimizer steps per rollout (> 1: the ratio and its clip matter)
    loss_type="dapo",         # grpo | dapo | dr_grpo (policy_loss)
    scale_rewards="group",    # group | batch | none (Dr. GRPO)
    clip_low=0.2,             # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high=0.2,            # 0.28: DAPO's clip-higher
    cispo_cap=5.0,            # cispo: the ratio's absolute cap (TRL's epsilon_high there; ScaleRL's 5.0)
    importance_level="token",  # token | sequence (GSPO)
    beta=0.0,                 # k3 KL to the reference (0: no reference model is held)
    kl_ratio=True,            # the k3 term times the ratio (TRL's use_bias_correction_kl)
    dynamic_sampling=False,   # leave out groups whose rewards are all equal (DAPO; refill: refill_rounds, selection.py)
    entropy_coeff=0.0,        # loss - this x the completions' mean entropy of softmax(logits / temperature) (verl)
    mask_truncated=False,     # completions cut at max_new_tokens count no token (DAPO's overlong filtering)
    reward_truncated=False,   # a completion cut at max_new_tokens keeps its reward (False: it earns 0)
    dead_steps=20,            # warn when no step of this many in a row had a learning signal (posttrain/diagnose.py)
    rollout_copy=True,        # rollouts read a copy in the compute dtype (main; False: the trained weights)
    out_dir="out/grpo",       # checkpoints and metrics
)
EXTRA = config.Keys({k: chat.CHAT_DEFAULTS[k] for k in ("chat_template", "skip_bad_records", "chat_limit")}, lifecycle.TRAIN,
                    DEFAULTS, selection.KEYS, instead={"chat_data": "grpo.py reads prompts from prompt_data"},
                    replaces={"prompt_data": ("task", "task_args")})  # on the command line: the file's task drops
# a log line's means over its steps: name -> (the tally's sum, what it is divided by)
LOGGED = {"reward": ("reward", "rewarded"), "frac_equal_groups": ("equal", "groups"), "kl": ("kl", "tokens"),
          "entropy": ("neglogp", "gen_tokens"), "rounds": ("rounds", "steps"),  # rounds: with refill_rounds
          "clip_low": ("clip_low", "clip_count"), "clip_high": ("clip_high", "clip_count"),
          "t_rollout": ("t_rollout", "steps"), "t_reward": ("t_reward", "steps"), "t_learn": ("t_learn", "steps")}
CISPO = {**{k: v for k, v in LOGGED.items() if k[:4] != "clip"}, "cispo_clip": ("clip_high", "clip_count")}  # TRL's
RESUME_FREE = ("eval_prompts", "dead_steps", "eval_prompt_data", "eval_percent")  # a resumed run may change it (with lifecycle.RESUME_FREE)

# ----------------------------------------------------------------------------- the math

def nanstd(x, dim=-1):
    """Sample standard deviation (Bessel-corrected) along dim, ignoring NaNs; NaN with fewer than two values."""
    n = (~x.isnan()).sum(dim)
    var = (x - x.nanmean(dim, keepdim=True)).nan_to_num(0.0).square().sum(dim) / (n - 1)
    return var.sqrt().masked_fill(n < 2, float("nan"))


def advantages(rewards, G, scale="group", eps=1e-4):
    """rewards (N,) in groups of G consecutive completions (NaN: no reward) -> advantages (N,).
    A = r - group mean, / (sample std + eps) of the group ("group") or batch ("batch"), or not
    ("none": Dr. GRPO); a missing reward is left out of the statistics, its A = 0."""
    r = rewards.float().view(-1, G)
    a = r - r.nanmean(dim=1, keepdim=True)
    if scale == "group":
        a = a / (nanstd(r)[:, None] + eps)
    elif scale == "batch":
        a = a / (nanstd(r.flatten()) + eps)
    elif scale != "none":
        raise ValueError(f"scale={scale!r} must be one of {', '.join(SCALES)}")
    return a.nan_to_num(0.0).flatten()


def k3(ref_logp, logp):
    """Schulman's k3 estimate of KL(policy || reference) per token: exp(d) - d - 1, d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return d.exp() - d - 1


def policy_loss(logp, old_logp, adv, mask, *, loss_type="dapo", eps_low=0.2, eps_high=None, beta=0.0,
                ref_logp=None, kl_ratio=True, level="token", n_seqs=None, n_tokens=None, max_len=None):
    """The clipped surrogate of one micro-batch -> (loss, sums for logging). logp, old_logp, ref_logp,
    mask (B, N): the completion tokens' log-probs under the policy (differentiable), the rollout policy
    and the reference (a frozen initial copy; LoRA: lora.disabled's base), and which count; adv (B,).
    Per token -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta k3 (times the ratio with
    kl_ratio: the unbiased reverse-KL gradient, DeepSeek-V3.2, TRL's use_bias_correction_kl), the ratio
    to the rollout policy per token or per completion (level "sequence": GSPO); then "grpo": token mean
    per completion, then mean; "dapo": sum / the step's tokens; "dr_grpo": sum / (completions x
    max_new_tokens). eps_high > eps_low: DAPO's clip-higher. Normalisers default to this batch's (n_seqs
    rows, n_tokens = mask.sum(), max_len = N); a step split over micro-batches and ranks passes its
    totals / the data-parallel world (which averages gradients): the parts add up to the whole."""
    mask = mask.float()
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio = logp - old_logp
    if level == "sequence":  # GSPO: one ratio per completion, exp(mean token log-ratio)
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    elif level != "token":
        raise ValueError(f"importance_level={level!r} must be token or sequence")
    ratio = log_ratio.exp()
    A = adv[:, None].to(ratio.dtype)
    per_token = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    kl = k3(ref_logp, logp) if beta else torch.zeros_like(logp)
    per_token = per_token + beta * (kl * ratio if kl_ratio else kl)
    n_seqs = logp.shape[0] if n_seqs is None else n_seqs
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seqs
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / (mask.sum() if n_tokens is None else n_tokens)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (n_seqs * (logp.shape[1] if max_len is None else max_len))
    elif loss_type in ("cispo", "sapo"):
        loss = objectives.policy_loss(logp, old_logp, adv, mask, loss_type=loss_type, eps_low=eps_low, eps_high=eps_high, beta=beta,
                                      ref_logp=ref_logp, kl_ratio=kl_ratio, level=level, n_seqs=n_seqs, n_tokens=n_tokens)
    else:
        raise ValueError(f"loss_type={loss_type!r} must be one of {', '.join(LOSS_TYPES)}")
    with torch.no_grad():  # logged as TRL logs them: k3 (times the ratio with kl_ratio), clip fractions
        kl_sum = (kl * ratio if kl_ratio else kl) * mask  # per token; at sequence level per row (objectives.clip_sums)
        clip = objectives.clip_sums(ratio, adv, mask, eps_low, eps_high - 1 if loss_type == "cispo" else eps_high)
        if loss_type == "cispo":  # TRL's cispo_clip_ratio: the ratio above the cap itself (A > 0); no low clip
            clip[0] = 0
        sums = torch.cat([kl_sum.sum()[None], clip[[0, 1, 3]], mask.sum()[None]])
    return loss, sums  # [kl, clipped low, clipped high, what the clip fractions count, tokens]


def token_logprobs(fwd, tokens, mask, start, temperature=1.0):
    """log p(tokens[:, t] | tokens[:, :t]) for t >= start under fwd (a Transformer, TP or not, or its FSDP
    wrapper) with logits / temperature -> (R, S - start), 0 where mask (R, S) is False (Rollout's)."""
    y = tokens[:, 1:].masked_fill(~mask[:, 1:], IGNORE)
    y[:, :start - 1] = IGNORE
    nll = fwd(tokens[:, :-1], y, reduction="none", attn_mask=mask[:, :-1], temperature=temperature)
    return -nll[:, start - 1:]


# ----------------------------------------------------------------------------- rollout, rewards, learning

def rollout_seed(seed, step, grid):
    """A step's sampling seed on this rank: its data rank's (not the global rank's: a group's TP ranks agree)."""
    return ((seed * 1_000_003 + step) * 65_537 + grid.data_rank) % 2**62


@dataclass
class Batch:
    """This rank's share of a step's completions, ready to learn from."""
    tokens: torch.Tensor     # (R, S) left-padded prompts, then completions (generate.Rollout's)
    mask: torch.Tensor       # (R, S) real tokens
    start: int               # the first completion column
    old: torch.Tensor        # (R, N) rollout log-probs (of logits / temperature)
    loss_mask: torch.Tensor  # (R, N) completion tokens that count, the end-of-turn token included
    adv: torch.Tensor        # (R,)
    n_seqs: float = 1.0      # the step's normalisers, over every rank: completions kept
    n_tokens: float = 1.0    #   and tokens counted
    ref: torch.Tensor = None  # (R, N) reference log-probs when beta > 0


def score(r, rewards, grid, cfg, stops, limit=None):
    """A Rollout and this rank's rewards (NaN: none) -> (Batch, stats). A completion cut at max_new_tokens
    earns 0 unless reward_truncated (an answer that never ended is not an answer). Every data rank's
    rewards are gathered before the group statistics; dynamic_sampling leaves out groups of equal rewards (and
    those past the first `limit` others), mask_truncated completions that did not stop. stats: global sums
    {reward, rewarded, equal (groups of equal rewards), groups, truncated (did not stop), gen_tokens, neglogp}."""
    G, R, T, dev = cfg.group_size, rewards.numel(), r.prompt_len, rewards.device
    every, stopped = selection.gather_rewards(r, rewards, grid, stops, cfg.reward_truncated)
    mine = slice(grid.data_rank * R, (grid.data_rank + 1) * R)
    adv = advantages(every, G, cfg.scale_rewards)
    equal = ~(nanstd(every.view(-1, G)) > 0)  # all equal (or fewer than two rewards): no signal
    keep = ~equal if cfg.dynamic_sampling else torch.ones_like(equal)
    keep = (keep & (keep.cumsum(0) <= (limit or len(keep)))).repeat_interleave(G)  # refill: only the first `limit`
    loss_mask = r.mask[:, T:] & keep[mine, None]
    if cfg.mask_truncated:
        loss_mask &= stopped[:, None]
    counts = torch.stack([loss_mask.sum(), (~stopped).sum(), r.lengths.sum(), -r.logprobs.sum()])  # logprobs: 0 after
    counts = parallel.data_sum(counts.float(), grid)
    stats = {"reward": every.nansum().item(), "rewarded": (~every.isnan()).sum().item(), "equal": equal.sum().item(),
             "groups": equal.numel(), "truncated": counts[1].item(), "gen_tokens": counts[2].item(),
             "neglogp": counts[3].item()}
    return Batch(r.tokens, r.mask, T, r.logprobs, loss_mask, adv[mine].to(dev), keep.sum().item(),
                 counts[0].item()), stats


@torch.no_grad()
def reference_logprobs(fwd, batch, cfg):
    """(R, N) log-probs of the completions under fwd (the reference) with logits / temperature."""
    mb = cfg.micro_batch_size
    return torch.cat([token_logprobs(fwd, batch.tokens[i:i + mb], batch.mask[i:i + mb], batch.start, cfg.temperature)
                      for i in range(0, batch.tokens.shape[0], mb)])


def learn(net, batch, cfg, autocast=contextlib.nullcontext(), hooks=()):
    """cfg.grpo_epochs optimizer steps on this rank's batch, each over micro-batches (gradients accumulated,
    reduced over data ranks on the last) -> the sums (kl, clipped low / high, tokens) of the last, its grad norm.
    The caller sets the learning rate (optim.set_lr). hooks: net.step's before_update, after_update (the Probe's)."""
    world, mb, R = net.grid.data_world, cfg.micro_batch_size, batch.tokens.shape[0]
    n_seqs, n_tokens = max(batch.n_seqs, 1) / world, max(batch.n_tokens, 1) / world
    for _ in range(cfg.grpo_epochs):
        sums = 0
        for i in range(0, R, mb):
            rows = slice(i, i + mb)
            with net.no_sync() if i + mb < R else contextlib.nullcontext():
                with autocast:  # entropy_coeff: the entropies too, from the full logits
                    args = net, batch.tokens[rows], batch.mask[rows], batch.start, cfg.temperature
                    logp, ent = objectives.logprobs_and_entropy(*args) if cfg.entropy_coeff else (token_logprobs(*args), 0)
                loss, s = policy_loss(
                    logp.float(), batch.old[rows], batch.adv[rows], batch.loss_mask[rows], loss_type=cfg.loss_type,
                    eps_low=cfg.clip_low, eps_high=cfg.cispo_cap if cfg.loss_type == "cispo" else cfg.clip_high,
                    beta=cfg.beta, kl_ratio=cfg.kl_ratio,
                    ref_logp=None if batch.ref is None else batch.ref[rows], level=cfg.importance_level,
                    n_seqs=n_seqs, n_tokens=n_tokens, max_len=cfg.max_new_tokens)
                if cfg.entropy_coeff:  # verl's bonus: pg_loss - entropy_coeff x the entropy, normalised as the loss
                    loss = loss - cfg.entropy_coeff * objectives.aggregate(ent, batch.loss_mask[rows], cfg.loss_type,
                                                                          n_seqs, n_tokens, cfg.max_new_tokens)
                net.backward(loss)
            sums = sums + s
        norm = net.step(cfg.grad_clip, *hooks)
    return sums, norm


# ----------------------------------------------------------------------------- the stage

def check(cfg, grid):
    """Settings that cannot work, found before any work is spent."""
    G, need = cfg.group_size, config.need
    for key, allowed in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALES), ("importance_level", ("token", "sequence"))):
        need(getattr(cfg, key) in allowed, f"{key}={getattr(cfg, key)!r} must be one of {', '.join(allowed)}")
    need(G >= 2, f"group_size={G} must be >= 2 (advantages compare samples of one prompt)")
    need(cfg.batch_size % G == 0, f"batch_size={cfg.batch_size} (completions per step): a multiple of group_size={G}")
    need(0 <= cfg.clip_low < 1 and cfg.clip_high >= 0, f"clip_low={cfg.clip_low} must be in [0, 1), clip_high >= 0")
    for key, ok, rule in (("beta", cfg.beta >= 0, ">= 0"), ("temperature", cfg.temperature > 0, "> 0: rollouts sample"),
                          ("entropy_coeff", cfg.entropy_coeff >= 0, ">= 0"),
                          *((k, getattr(cfg, k) >= 1, ">= 1") for k in ("max_new_tokens", "grpo_epochs", "train_prompts", "dead_steps"))):
        need(ok, f"{key}={getattr(cfg, key)} must be {rule}")  # (one line naming the key that is wrong)
    need(not (cfg.prompt_data and cfg.task_args), "task_args set the task; prompt_data replaces the task: give one")
    need(not cfg.eval_prompt_data or cfg.prompt_data, "eval_prompt_data is held out from prompt_data: set both")
    need(cfg.ep == 1, f"ep={cfg.ep}: expert-parallel ranks would stop decoding at different steps; use ep=1")
    need(cfg.pp == 1, f"pp={cfg.pp}: GRPO's rollouts decode with the whole model, which a pipeline stage does not hold; use pp=1")
    need(not cfg.eval_every or cfg.eval_prompts >= grid.data_world,
         f"eval_prompts={cfg.eval_prompts} must be >= the {grid.data_world} data ranks")


def main(argv):
    # ------------------------------------------------------------------------ config, grid, the run folder
    cfg = config.load(argv, extra=EXTRA, script=__file__, example="configs/grpo_tiny.py")
    grid = parallel.init(cfg, cfg.threads)
    clock, say = lifecycle.Clock(grid.device), lifecycle.say(grid)
    autocast = parallel.autocast(cfg, grid.device)
    device, G, P = grid.device, cfg.group_size, cfg.batch_size // cfg.group_size
    started, tok, template = weights.configure_chat(cfg, grid.world)  # init_from's shape, the template's tokens
    check(cfg, grid)
    lifecycle.preflight(cfg, grid)  # the GPUs and the memory plan, said once (--gpu_memory: the plan, then exit)
    train, test, reward, accuracy_fn, note = prompts.for_run(cfg)  # a task's, or prompt_data's
    train_ids, test_ids = ([chat.encode(tok, template, it["prompt"], add_generation_prompt=True)[0] for it in items]
                           for items in (train, test))
    longest = max(map(len, train_ids + test_ids))
    config.need(longest + cfg.max_new_tokens <= cfg.block_size, f"prompts of up to {longest} tokens + max_new_tokens="
                f"{cfg.max_new_tokens} exceed block_size={cfg.block_size}: generate fewer tokens")
    stops = sorted({tok.eot_id, tok.eos_id})  # a completion ends with (and learns) its end-of-turn token
    sampling = dict(vocab=tok, temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p,
                    stop_tokens=stops, pad_id=0, compile=cfg.compile and device.type == "cuda")  # on a GPU the decode step compiled, then captured
    lease = lifecycle.claim(cfg, grid, free=RESUME_FREE)  # out_dir locked, resume picked, settings checked
    for line in [started, *lease.notes, f"config:\n{config.show(cfg)}",
                 f"data: {note}; {P} prompts x {G} samples per step", lifecycle.layout(cfg, grid)]:
        say(line)

    # ------------------------------------------------------------------------ policy, reference, resume
    raw = weights.build_model(cfg, grid)  # from the same seed on every rank: identical initial weights
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    ref = weights.build_net(cfg, grid, weights.loader(cfg, grid), frozen=True) if cfg.beta and not cfg.lora_r else None  # frozen start (LoRA: its base)
    # rollouts and evals read a bf16 copy (generate.cast_copy; graphs kept: captured once), refreshed before use;
    # raw under TP (cut weights), LoRA (unmerged adapters), MoE (no nn.Linear experts), FSDP (a full copy per rank)
    plain = cfg.rollout_copy and grid.tp == 1 and not (cfg.lora_r or cfg.n_experts or cfg.data_parallel == "fsdp")
    policy, keep = (generate.cast_copy(raw, parallel.amp_dtype(cfg, device)) if plain else raw), {}

    def rewards_of(r, items, which):
        """prompts.judge of r's completions: (rewards (N,), NaN where none; {key: [sum, count]} to log)."""
        total, sums = prompts.judge(reward, accuracy_fn, [items[i] for i in which], r.texts(tok, stops))
        return torch.tensor([float("nan") if v is None else float(v) for v in total], device=device), sums

    def evaluate():
        """Held-out prompts over the data ranks, G samples (fixed seed) and greedy: mean rewards, strict / lenient accuracy."""
        mine = list(range(grid.data_rank, len(test), grid.data_world))
        with net.full_params(), autocast:
            model, prompts_ = generate.refresh(policy, raw), [test_ids[i] for i in mine]
            sampled = generate.decode(model, prompts_, cfg.max_new_tokens, n=G,
                                      **{**sampling, "seed": rollout_seed(cfg.seed, -1, grid)})
            greedy = generate.decode(model, prompts_, cfg.max_new_tokens, **{**sampling, "temperature": 0})
        (s, _), (g, judged) = (rewards_of(out, test, [i for i in mine for _ in range(k)]) for out, k in ((sampled, G), (greedy, 1)))
        m = logs.means({"heldout_reward": [s.nan_to_num(0.0).sum().item(), s.numel()],
                        "heldout_greedy": [g.nan_to_num(0.0).sum().item(), g.numel()],
                        **{k.replace("accuracy", "heldout"): v for k, v in judged.items() if k.startswith("accuracy_")}},
                       grid.data_group, device)
        logger.log(step, m)
        history.append({"step": step, **m})
        lifecycle.track_held(held, step, m.get("heldout_lenient", m["heldout_greedy"]))
        say(f"step {step} | held-out ({len(test)} prompts) | " + logs.fmt(m))

    def save():
        saved["path"] = lifecycle.save(net, cfg, lease, step, {})[0]

    def sample(idx, n, at, j=0):
        """This data rank's share of n samples of each train[idx] (step at, round j): Rollout, rewards_of's, seconds."""
        t = clock.now()
        with net.full_params(), autocast:  # FSDP: parameters gathered once for the whole rollout
            r, which = generate.rollout(generate.refresh(policy, raw), [train_ids[i] for i in idx], n, grid.data_rank,
                                        grid.data_world, cfg.max_new_tokens, seed=rollout_seed(cfg.seed + j, at, grid),
                                        keep=keep, **sampling)
        t = clock.now() - t
        return r, *rewards_of(r, [train[i] for i in idx], which), t

    def one_round(j, need):  # this step's round j (selection.refill): its Batch (<= need informative groups), stats
        t0 = clock.now()
        r, got, judged, t_rollout = sample(selection.prompts_of(step, j, P, len(train), cfg.refill_rounds), G, step, j)
        logs.add(judged_tally, judged)  # reward parts, accuracy: this rank's [sum, count]
        batch, stats = score(r, got, grid, cfg, stops, need)
        return batch, {**stats, "t_rollout": t_rollout, "t_reward": clock.now() - t0 - t_rollout}

    train, train_ids = selection.by_pass_rate((train, train_ids), sample, cfg, grid, stops, say)  # filter_pass_rate
    trainer, step = lifecycle.resume(lease, net, say)  # prompts and sampling seeds follow from the step
    logger = logs.Logger(cfg, grid)
    probe = gradstats.Probe(net, cfg)  # grad_stats_every > 0: per-layer statistics on their steps
    held, saved, history = lease.held, {}, []  # the held-out metric at the run's first and latest evaluation; the latest checkpoint

    # ------------------------------------------------------------------------ training loop
    if cfg.eval_every and step == 0:
        evaluate()
    last, interrupt, stopped = cfg.stop_at or cfg.max_steps, lifecycle.Interrupt(grid, cfg.max_minutes), False
    tally, judged_tally, first = {}, {}, step + 1  # what the log line reports, summed over its steps
    dead, logged, warned = 0, step, {}  # steps in a row without signal (diagnose.dead), the warnings said
    while step < last:
        (batch, stats), t2 = selection.refill(one_round, P, G, cfg.refill_rounds, grid), clock.now()  # refill_rounds: more
        if cfg.beta:
            with (contextlib.nullcontext() if ref else lora.disabled(raw)), net.full_params(), autocast:
                batch.ref = reference_logprobs(ref if ref else raw, batch, cfg)
        lr = optim.set_lr(net.optimizer, step, cfg)
        probe.before(step)  # a statistics step (every grad_stats_every): activation hooks armed
        sums, norm = (learn(net, batch, cfg, autocast, probe.hooks) if batch.n_seqs  # dynamic sampling may leave
                      else (torch.zeros(5, device=device), torch.zeros(())))          # no group
        kl, low, high, clip_count, tokens = parallel.data_sum(sums.detach().float(), grid).tolist()
        t3 = clock.now()
        logs.add(tally, {**stats, "kl": kl, "clip_low": low, "clip_high": high, "clip_count": clip_count, "tokens": tokens,
                         "t_learn": t3 - t2, "steps": 1})
        step += 1
        probe.after(step, logger, say)  # its statistics logged, the ratio warning said
        if step == first:
            say(f"first step done {clock.since_start():.1f} s after start")
        if step % cfg.log_every == 0 or step == last:  # means over the steps since the last log line
            n = tally["groups"] * G  # completions, every refill round's
            m = {k: tally[a] / max(tally[b], 1) for k, (a, b) in (CISPO if cfg.loss_type == "cispo" else LOGGED).items()
                 if a in tally}
            m.update(len=tally["gen_tokens"] / n, truncated=tally["truncated"] / n, grad_norm=float(norm), lr=lr,
                     gen_tok_s=tally["gen_tokens"] / tally["t_rollout"], **logs.means(judged_tally, grid.data_group, device))
            logger.report(step, m, cfg.max_steps, say)
            tally, judged_tally, why = {}, {}, diagnose.dead(m, cfg)
            dead, logged = (dead + step - logged if why else 0), step
            history.append({"step": step, **m})
            found = [(why, f"no learning signal in the last {dead} steps: {why}")] if why and dead >= cfg.dead_steps else []
            for kind, line in found + diagnose.warnings(history):  # each kind once per run (say: rank 0)
                if not warned.get(kind):
                    warned[kind] = True
                    say(f"warning: {line}")
        stopped = lifecycle.end_of_step(step, last, cfg, interrupt, save, evaluate if cfg.eval_every else None, say, clock)
        if stopped:
            break
    interrupt.restore()
    lifecycle.summary(say, "GRPO", step, clock, saved.get("path"), "greedy reward", held, stopped)
    logger.close()


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
