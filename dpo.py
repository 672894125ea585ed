"""Preference optimisation (DPO and its variants), top to bottom: the math, then main().

    python dpo.py configs/dpo_tiny.py                             # after sft_tiny: init_from=out/sft_tiny
    torchrun --nproc_per_node=2 dpo.py configs/dpo_tiny.py --lora_r=8 --lr=1e-3   # reference: adapters off

A sequence log-prob is the SUM of log pi(y_t | prompt, y_<t) over an answer's tokens (content and
end of turn), by the model's loss path (sequence_logps); one forward a micro-batch, rows [prompt +
chosen; prompt + rejected]. With D = (pi_c - ref_c) - (pi_r - ref_r) the loss per pair is one of
LOSS_TYPES (pair_losses), a mean over the global batch, + rpo_alpha * the chosen answers' NLL
(objective); the metrics are TRL's (metrics). The reference (cfg.reference): make_reference. Data:
chat_data's preference records, else the task's pairs (read_pairs), tokenised once with the chat
template and cut to T+1 tokens (tokenize).

Invariants: a global batch's loss, gradients and metrics do not depend on the layout or the
micro-batching (every micro-step's and rank's terms are divided by the global batch's counts); the
reference never gets a gradient, and resume rebuilds it as DPO started (never from the resumed
policy) and checks it: its held-out log-probs are saved in every checkpoint.
"""
import hashlib
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import chat
import checkpoint
import config
import lifecycle
import logs
import lora
import optim
import parallel
import weights
from config import need
from model import IGNORE
from posttrain import objectives, tasks
from tools import gradstats

# ours below, then TRL's other pair-local types (objectives.py, parity-tested against TRL). Not taken: aot and
# aot_unpaired (sorted over the batch: the loss would depend on how pairs are split over micro-batches and
# ranks), WPO's weighting (it needs log sum_v p_v^2 per token, which the vocab-parallel loss path does not give)
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "cdpo", "simpo", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
              "apo_zero", "apo_down", "discopop", "sigmoid_norm")
SMOOTHED = ("robust", "cdpo", "simpo", "exo_pair")  # the types that read label_smoothing
REFERENCES = ("auto", "copy", "adapters", "precomputed")
DPO_DEFAULTS = dict(
    task="arithmetic",       # tasks.get(task).pairs(): the pairs when chat_data (chat.CHAT_DEFAULTS) is ""
    task_args={},            # the task's settings, e.g. dict(max_operand=999, worked=True) (tasks.settings(name))
    n_pairs=2000,            # training pairs drawn from the task (chat_data: 0 = all of its pairs)
    eval_pairs=200,          # held-out pairs (the task's test questions; chat_data: its last after a shuffle)
    beta=0.1,
    loss_type="sigmoid",     # sigmoid | ipo | hinge | robust | cdpo | simpo
    label_smoothing=0.0,     # eps of robust, cdpo, simpo (TRL's CPO) and exo_pair, in [0, 0.5)
    f_divergence="reverse_kl",  # f-DPO: reverse_kl (DPO) | forward_kl | js_divergence | alpha_divergence
    simpo_gamma=0.5,         # SimPO's margin
    rpo_alpha=0.0,           # weight of the chosen answers' NLL (RPO); 0: none
    reference="auto",        # auto | copy | adapters | precomputed
    out_dir="out/dpo",       # checkpoints and metrics
)
# this script's keys (config.load(extra=...)): the chat data's it reads, the training keys and its own
EXTRA = config.Keys(
    {k: chat.CHAT_DEFAULTS[k] for k in ("chat_data", "chat_template", "skip_bad_records", "chat_limit")},
    lifecycle.TRAIN, DPO_DEFAULTS,
    instead={**{k: "dpo.py reads preference pairs from chat_data" for k in ("prompt_data", "data")},
             "n_train": "dpo.py draws n_pairs pairs from the task", "n_eval": "dpo.py holds out eval_pairs pairs"})


# ----------------------------------------------------------------------------- the math

def pair_losses(pc, pr, rc, rr, lc, lr, loss_type="sigmoid", beta=0.1, eps=0.0, gamma=0.5, divergence="reverse_kl"):
    """Per-pair losses (B,) from summed log-probs of the policy (pc, pr) and reference (rc, rr) on
    the chosen / rejected answers, whose token counts are lc, lr (ipo, simpo). D = (pc - rc) -
    (pr - rr), s = sigmoid, eps = label_smoothing:
        sigmoid  -log s(beta D)                                   DPO, TRL's default
        ipo      (D_tok - 1/(2 beta))^2, log-ratios divided by their answer's tokens (as TRL)
        hinge    relu(1 - beta D)
        robust   (-(1-eps) log s(beta D) + eps log s(-beta D)) / (1 - 2 eps)       (as TRL)
        cdpo     -(1-eps) log s(beta D) - eps log s(-beta D)   conservative DPO (TRL <= 0.28's sigmoid)
        simpo    -(1-eps) log s(z) - eps log s(-z), z = beta (pc/lc - pr/lr) - gamma   reference-free (TRL's CPO)
    objectives.pair_losses computes them (and the rest, exo_pair ... sigmoid_norm, and the f-divergences) as TRL,
    but simpo (objectives.simpo_loss) and cdpo (here)."""
    if loss_type == "simpo":  # reference-free: the reference terms are not read
        return objectives.simpo_loss(pc, pr, lc, lr, beta, gamma, eps)
    if loss_type == "cdpo":
        z = beta * ((pc - rc) - (pr - rr))
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    return objectives.pair_losses(pc, pr, rc, rr, lc, lr, loss_type, beta, eps, divergence=divergence)


def sequence_logps(fwd, x, y):
    """(B,) sums of log p(y_t) where y != IGNORE (the answers), by the model's loss path: -fwd(x, y,
    reduction="none") is (B, T) fp32 log-probs, 0 where ignored (TP: vocab-parallel, logits never gathered)."""
    return -fwd(x, y, reduction="none").sum(-1)


def objective(logps, ref_logps, lens, cfg, n_pairs, n_tokens):
    """logps, ref_logps, lens (2b,): summed log-probs and answer lengths, rows [chosen; rejected] ->
    (loss to backward, {metric: sum} of this micro-batch: pairs, their losses, TRL's rewards / logps,
    policy/accuracy, nll, tokens). The loss: pair_losses' mean over the global batch + rpo_alpha * the
    chosen answers' NLL, a token mean over the global batch (RPO). n_pairs, n_tokens: the global batch's
    pairs and chosen-answer tokens / the data-parallel world (DataParallel and FSDP average gradients
    over ranks), so that the terms of every micro-step and rank add up to the global batch's mean."""
    (pc, pr), (rc, rr), (lc, lr) = logps.chunk(2), ref_logps.chunk(2), lens.to(logps).chunk(2)
    losses = pair_losses(pc, pr, rc, rr, lc, lr, cfg.loss_type, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma,
                         cfg.f_divergence)
    loss = losses.sum() / n_pairs
    if cfg.rpo_alpha:
        loss = loss - cfg.rpo_alpha * pc.sum() / n_tokens
    with torch.no_grad():  # the implicit rewards: beta * log-ratio (simpo: beta * mean log-prob)
        b = cfg.beta
        c, r = (b * pc / lc, b * pr / lr) if cfg.loss_type == "simpo" else (b * (pc - rc), b * (pr - rr))
        sums = {"pairs": torch.tensor(float(len(pc)), device=pc.device), "loss": losses, "rewards/chosen": c,
                "rewards/rejected": r, "rewards/accuracies": (c > r).to(c), "rewards/margins": c - r,
                "logps/chosen": pc, "logps/rejected": pr, "policy/accuracy": (pc > pr).to(c), "nll": -pc, "tokens": lc}
        return loss, {k: t.sum().detach() for k, t in sums.items()}


def metrics(sums, group=None, prefix="", rpo_alpha=0.0):
    """objective()'s summed metrics of this rank -> means over every data-parallel rank (one
    all-reduce over group); loss = the pair losses' mean + rpo_alpha * nll (the chosen answers'
    token-mean NLL). TRL's names and meaning: rewards/chosen = mean beta (pi_c - ref_c) (simpo:
    beta pi_c / |c|), rewards/rejected, rewards/accuracies (strictly greater: 0 while policy ==
    reference), rewards/margins, logps/chosen, logps/rejected; policy/accuracy: pi_c > pi_r."""
    keys, flat = list(sums), torch.stack(list(sums.values()))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    s = dict(zip(keys, flat.tolist()))
    out = {prefix + k: v / max(s["pairs"], 1) for k, v in s.items() if k not in ("pairs", "nll", "tokens")}
    out[prefix + "nll"] = s["nll"] / max(s["tokens"], 1)
    out[prefix + "loss"] += rpo_alpha * out[prefix + "nll"]
    return out


# ----------------------------------------------------------------------------- batches

def collate(seqs, device="cpu"):
    """[(prompt, chosen, rejected ids)] -> x, y (2b, L): rows [prompt+chosen ...; prompt+rejected ...]
    right-padded (pad id 0, never attended to by a real token); y: the next token if an answer's, else IGNORE."""
    rows = [(p, p + c) for p, c, _ in seqs] + [(p, p + r) for p, _, r in seqs]
    x = pad_sequence([torch.tensor(full[:-1]) for _, full in rows], batch_first=True)
    y = pad_sequence([torch.tensor([IGNORE] * (len(p) - 1) + full[len(p):]) for p, full in rows], batch_first=True,
                     padding_value=IGNORE)
    return x.to(device), y.to(device)


def step_indices(step, n, batch_size, seed):
    """The global batch of `step`: pair indices from a seeded permutation per epoch (its last partial
    batch dropped). A function of the step alone: the same on every rank; resume needs only the step."""
    epoch, k = divmod(step, n // batch_size)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


@torch.no_grad()
def pair_logps(fn, seqs, ids, mb, grid, autocast):
    """(len(ids), 2) [chosen, rejected] log-probs fn(x, y, idx) of pairs seqs[ids], each by one data rank, then
    shared; every rank runs as many micro-batches (TP / FSDP forwards are collective), spares redo ids[0]."""
    out = torch.zeros(len(ids), 2, device=grid.device)
    for start in range(0, len(ids), mb * grid.data_world):
        mine = [j for j in range(start + grid.data_rank * mb, start + (grid.data_rank + 1) * mb) if j < len(ids)]
        batch = [ids[j] for j in mine] or [ids[0]]
        x, y = collate([seqs[i] for i in batch], grid.device)
        with autocast:
            c, r = fn(x, y, batch).float().chunk(2)
        out[mine] = torch.stack([c, r], 1)[:len(mine)]
    parallel.data_sum(out, grid)
    return out


# ----------------------------------------------------------------------------- policy, reference, one step

def make_reference(kind, cfg, grid, net, seqs, autocast, table=None, load=None):
    """The reference, never given a gradient: (x, y, pair indices) -> (2b,) log-probs under no_grad.
    kind (check's; "auto": adapters with LoRA, else copy): "copy", a frozen model loaded from init_from,
    in eval mode; "adapters" (LoRA), the policy with its adapters off (lora.disabled: no second copy);
    "precomputed", `table`, else one pass now by the policy, which must not have trained yet (main keeps
    it in out_dir/ref_logps.pt: no reference model while training); "none" (simpo): zeros, never read."""
    if kind == "copy":
        ref = weights.build_net(cfg, grid, load, frozen=True)
        ref.raw.eval()
        fn = torch.no_grad()(lambda x, y, idx: sequence_logps(ref, x, y))
        fn.model = ref.raw  # for the tests: it never receives a gradient
        return fn
    if kind == "adapters":
        @torch.no_grad()
        def adapters_off(x, y, idx):
            with lora.disabled(net.raw):
                return sequence_logps(net, x, y)
        return adapters_off
    if kind == "precomputed":  # by the policy before it trains: it is the reference then
        table = policy_logps(net, seqs, range(len(seqs)), cfg, grid, autocast) if table is None else table
        return lambda x, y, idx: torch.cat([table[idx, 0], table[idx, 1]]).to(x.device)
    return lambda x, y, idx: torch.zeros(x.shape[0], device=x.device)


def policy_logps(net, seqs, ids, cfg, grid, autocast):
    """(len(ids), 2) log-probs of pairs seqs[ids] by the policy in eval mode (pair_logps)."""
    net.raw.eval()
    out = pair_logps(lambda x, y, idx: sequence_logps(net, x, y), seqs, ids, cfg.micro_batch_size, grid, autocast)
    net.raw.train()
    return out


def train_step(net, reference, seqs, batch, cfg, grid, autocast, hooks=()):
    """One optimizer step on the global batch (pair indices): this rank's share in micro-batches, each the
    reference's forward, then the policy's over [chosen; rejected] and backward. -> (metric sums, grad norm).
    hooks: net.step's before_update, after_update (gradstats.Probe.hooks)."""
    mb, dw = cfg.micro_batch_size, grid.data_world
    accum, n_pairs, n_tokens = cfg.batch_size // (mb * dw), cfg.batch_size / dw, sum(len(seqs[i][1]) for i in batch) / dw
    mine = batch[grid.data_rank * mb * accum:(grid.data_rank + 1) * mb * accum]
    micro, refs = [], []
    for k in range(accum):  # the reference's log-probs first (no gradient), then the policy's micro-steps
        ids = mine[k * mb:(k + 1) * mb]
        x, y = collate([seqs[i] for i in ids], grid.device)
        with autocast:
            refs.append(reference(x, y, ids).float())
        micro.append((x, y, dict(reduction="none")))

    def loss_fn(i, nll):  # nll (2b, T): the policy's -log-probs, sequence_logps' path; pp > 1: the last stage's
        y = micro[i][1]
        return objective(-nll.float().sum(-1), refs[i], (y != IGNORE).sum(-1), cfg, n_pairs, n_tokens)
    sums = net.train_step(micro, loss_fn, autocast)  # gradients reduced on the last (pp > 1: the schedule)
    return sums, net.step(cfg.grad_clip, *hooks)


# ----------------------------------------------------------------------------- data

def read_pairs(cfg):
    """-> (train, held-out, Counter of skipped records), [(prompt, chosen, rejected) messages]: chat_data's
    records (chat.read_pairs: text or messages, implicit prompts, files or hf:), shuffled (seed), the last
    eval_pairs held out; else the task's pairs on its training and, held out, its test questions (offline)."""
    if cfg.chat_data:
        pairs, skipped = chat.read_pairs(cfg.chat_data, skip_bad=cfg.skip_bad_records, limit=cfg.chat_limit)
        g = torch.Generator().manual_seed(cfg.seed)
        pairs = [(pairs[i].prompt, pairs[i].chosen, pairs[i].rejected) for i in torch.randperm(len(pairs), generator=g)]
        n_eval = min(cfg.eval_pairs, len(pairs) // 2)
        return pairs[:len(pairs) - n_eval][:cfg.n_pairs or None], pairs[len(pairs) - n_eval:], skipped
    task = tasks.get(cfg.task, cfg.task_args)
    train, held = task.pairs(cfg.n_pairs, cfg.seed), task.pairs(cfg.eval_pairs, cfg.seed, split="test")
    return [[(d["prompt"], d["chosen"], d["rejected"]) for d in ds] for ds in (train, held)] + [Counter()]


def tokenize(pairs, encode, T):
    """[(prompt, chosen, rejected) messages] -> ([(prompt, chosen, rejected ids)], Counter); encode(msgs,
    add_generation_prompt) -> (ids, mask) is chat.encode's. The prompt: the generation prompt's ids (as far
    as both renderings share them, as TRL); an answer: up to its last trained token (the end of turn).
    Sequences of at most T+1 tokens (T = seq_len or block_size): the prompt is kept whole, answers are
    cut (counted); a pair whose prompt leaves no room or whose answers become the same is skipped (counted)."""
    out, counts = [], Counter()
    for prompt, chosen, rejected in pairs:
        p, _ = encode(prompt, True)
        full = [encode(prompt + a, False) for a in (chosen, rejected)]
        n = len(os.path.commonprefix([p] + [ids for ids, _ in full]))  # works on lists of ids too
        answers = [ids[n:max((i for i in range(n, len(ids)) if mask[i]), default=n - 1) + 1] for ids, mask in full]
        cut = [a[:T + 1 - n] for a in answers]
        why = ("empty answer" if not all(answers) else "prompt longer than seq_len" if n > T else
               "chosen == rejected tokens (after the cut)" if cut[0] == cut[1] else None)
        counts.update([why] if why else ["answers cut to seq_len"] if cut != answers else [])
        if not why:
            out.append((p[:n], *cut))
    return out, counts


def check(cfg):
    """DPO's own settings, before any work is spent."""
    need(cfg.loss_type in LOSS_TYPES, f"loss_type={cfg.loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    need(cfg.reference in REFERENCES, f"reference={cfg.reference!r}: choose one of {', '.join(REFERENCES)}")
    need(cfg.beta > 0 and 0 <= cfg.label_smoothing < 0.5,
         f"beta={cfg.beta} must be > 0, label_smoothing={cfg.label_smoothing} in [0, 0.5)")
    need(not cfg.label_smoothing or cfg.loss_type in SMOOTHED, f"label_smoothing={cfg.label_smoothing}: "
         f"loss_type={cfg.loss_type!r} does not read it (TRL ignores it there too); smoothed: {', '.join(SMOOTHED)}")
    need(cfg.loss_type != "exo_pair" or cfg.label_smoothing > 0, "loss_type='exo_pair' needs label_smoothing > 0 "
         "(the paper: 1e-3)")
    need(cfg.f_divergence in objectives.F_DIVERGENCES and (cfg.f_divergence == "reverse_kl" or cfg.loss_type in
         objectives.F_DIVERGENCE_TYPES), f"f_divergence={cfg.f_divergence!r}: one of {', '.join(objectives.F_DIVERGENCES)}"
         f", other than reverse_kl only with {', '.join(objectives.F_DIVERGENCE_TYPES)}")
    need(min(cfg.rpo_alpha, cfg.n_pairs, cfg.eval_pairs) >= 0, "rpo_alpha, n_pairs and eval_pairs must be >= 0")
    need(cfg.chat_data or (cfg.task and cfg.n_pairs), "no pairs: set chat_data (file, folder, hf:) or task, n_pairs > 0")
    need(cfg.reference != "adapters" or cfg.lora_r > 0,
         "reference='adapters' is the policy with its LoRA adapters off: set lora_r > 0, or reference='copy'")
    auto = "adapters" if cfg.lora_r else "copy"
    return "none" if cfg.loss_type == "simpo" else auto if cfg.reference == "auto" else cfg.reference


def main(argv):
    # ------------------------------------------------------------------------ config, grid, the run folder
    cfg = config.load(argv, extra=EXTRA, script=__file__, example="configs/dpo_tiny.py")
    grid = parallel.init(cfg, cfg.threads)
    clock, say = lifecycle.Clock(grid.device), lifecycle.say(grid)
    autocast = parallel.autocast(cfg, grid.device)
    dropout = (cfg.dropout, cfg.lora_dropout)
    cfg.dropout = cfg.lora_dropout = 0.0  # log-probs must be deterministic (TRL's disable_dropout too)
    started, tok, template = weights.configure_chat(cfg, grid.world)  # init_from's shape, the template's tokens
    kind = check(cfg)
    lifecycle.preflight(cfg, grid)  # the GPUs and the memory plan, said once (--gpu_memory: the plan, then exit)
    T, mb = cfg.seq_len or cfg.block_size, cfg.micro_batch_size
    train_pairs, held_pairs, skipped = read_pairs(cfg)
    encode = lambda msgs, gen: chat.encode(tok, template, msgs, add_generation_prompt=gen)  # noqa: E731
    (train, cut), (held, cut_held) = tokenize(train_pairs, encode, T), tokenize(held_pairs, encode, T)
    seqs = train + held  # pair i < len(train): training; the rest held out
    if len(train) < cfg.batch_size:
        raise config.ConfigError(f"{len(train)} usable training pairs, fewer than batch_size={cfg.batch_size}: "
                                 f"more pairs (n_pairs, chat_data) or a smaller batch_size")
    lease = lifecycle.claim(cfg, grid)  # out_dir locked, resume picked, settings checked
    for line in [started, *lease.notes, f"config:\n{config.show(cfg)}"] + [
            f"dropout={dropout[0]}, lora_dropout={dropout[1]} -> 0: DPO compares exact log-probs"] * any(dropout) + [
            f"{what}: {dict(c)}" for what, c in (("records skipped", skipped), ("training pairs", cut),
                                                 ("held-out pairs", cut_held)) if c] + [
            f"data: {len(train)} training / {len(held)} held-out pairs from {cfg.chat_data or cfg.task}; "
            f"{cfg.loss_type} loss, reference {kind}",
            f"{lifecycle.layout(cfg, grid)} | {cfg.batch_size} pairs a step = {mb} x {grid.data_world} ranks x "
            f"{cfg.batch_size // (mb * grid.data_world)} micro-steps"]:
        say(line)

    # ------------------------------------------------------------------------ policy, reference, resume
    load = weights.loader(cfg, grid)
    net = weights.build_net(cfg, grid, load)
    table, held_ids = None, list(range(len(train), len(seqs))) or list(range(mb))  # (none held out: the first)
    if kind == "precomputed":  # by the policy now, before any step or resume: it is the reference
        cache, key = os.path.join(cfg.out_dir, "ref_logps.pt"), hashlib.sha256(repr(seqs).encode()).hexdigest()
        saved = parallel.on_main(grid, lambda: checkpoint.read_pt(cache) if lease.resume_from and
                                 os.path.isfile(cache) else None)
        fresh = not (saved and saved["key"] == key)
        table = policy_logps(net, seqs, range(len(seqs)), cfg, grid, autocast) if fresh else saved["table"].to(grid.device)
        if fresh and grid.is_main:
            torch.save({"key": key, "table": table.cpu()}, cache + ".tmp")
            os.replace(cache + ".tmp", cache)
        say(f"reference log-probs of {len(seqs)} pairs {'computed, kept in' if fresh else 'read from'} {cache}")
    reference = make_reference(kind, cfg, grid, net, seqs, autocast, table, load)
    ref_held = pair_logps(reference, seqs, held_ids, mb, grid, autocast).T.flatten()  # [chosen; rejected]
    lens = torch.tensor([len(seqs[i][k]) for k in (1, 2) for i in held_ids], device=grid.device)
    trainer, step = lifecycle.resume(lease, net, say)  # the policy and optimizer; the reference stays the start's
    if trainer:
        then = torch.tensor(trainer["loader"]["ref_held"], device=grid.device)
        tol = 1e-4 if parallel.amp_dtype(cfg, grid.device) == torch.float32 else 3e-2  # layouts round differently
        if not torch.allclose(ref_held, then, rtol=tol, atol=tol) and not cfg.force_resume:
            raise checkpoint.ResumeMismatch(f"the reference differs from the one this run started with (log-probs "
                                            f"{then[:3].tolist()} then, {ref_held[:3].tolist()} now): init_from "
                                            f"changed? Point it at the model DPO started from, or --force_resume=True")
        say("the reference is the one DPO started with (its held-out log-probs as then)")
    logger = logs.Logger(cfg, grid)
    probe = gradstats.Probe(net, cfg)  # grad_stats_every > 0: per-layer statistics on their steps
    held_out, saved = lease.held, {}  # the held-out metric at the run's first and latest evaluation; the latest checkpoint

    def evaluate():  # held-out metrics: eval_ + TRL's names
        pol = policy_logps(net, seqs, held_ids, cfg, grid, autocast).T.flatten()
        m = metrics(objective(pol, ref_held, lens, cfg, 1, 1)[1], None, "eval_", cfg.rpo_alpha)
        logger.log(step, m)
        lifecycle.track_held(held_out, step, m["eval_policy/accuracy"])
        say(f"step {step} | " + logs.fmt(m))

    def save():
        saved["path"] = lifecycle.save(net, cfg, lease, step, {"step": step, "ref_held": ref_held.tolist()})[0]

    # ------------------------------------------------------------------------ training loop
    if cfg.eval_every and step == 0:
        evaluate()
    last, interrupt, stopped = cfg.stop_at or cfg.max_steps, lifecycle.Interrupt(grid, cfg.max_minutes), False
    sums, logged = {}, step  # objective()'s metric sums since the last log line
    clock.lap()
    while step < last:
        lr = optim.set_lr(net.optimizer, step, cfg)
        batch = step_indices(step, len(train), cfg.batch_size, cfg.seed)
        probe.before(step)  # a statistics step (every grad_stats_every): activation hooks armed
        step_sums, grad_norm = train_step(net, reference, seqs, batch, cfg, grid, autocast, probe.hooks)
        logs.add(sums, step_sums)
        step += 1
        probe.after(step, logger, say)  # its statistics logged, the ratio warning said
        if step % cfg.log_every == 0 or step == last:
            m = {**metrics(sums, grid.data_group, rpo_alpha=cfg.rpo_alpha), "lr": lr, "grad_norm": grad_norm.item(),
                 "pairs_s": (step - logged) * cfg.batch_size / clock.lap(), "mem_gb": logs.peak_memory_gb(grid.device)}
            logger.report(step, m, cfg.max_steps, say)
            sums, logged = {}, step
        stopped = lifecycle.end_of_step(step, last, cfg, interrupt, save, evaluate if cfg.eval_every else None, say, clock)
        if stopped:
            break
    interrupt.restore()
    lifecycle.summary(say, "DPO", step, clock, saved.get("path"), "policy accuracy (prefers the chosen answer)",
                      held_out, stopped)
    logger.close()


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
