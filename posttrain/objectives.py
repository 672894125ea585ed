"""Objectives TRL has beyond dpo.py's and grpo.py's, as plain functions equal to TRL 1.16's on given inputs
(tests/test_objectives.py runs TRL's own trainers on the same log-probs), and the metrics TRL logs.

Preference pairs (TRL's DPOTrainer). Inputs per pair: summed answer log-probs of the policy (pc, pr) and
the reference (rc, rr), answer token counts (lc, lr). f_scores() maps the log-ratios to scores (reverse_kl:
as they are; forward_kl, js_divergence, alpha_divergence: f-DPO), delta = score_c - score_r, and
pair_losses() gives the per-pair loss of each loss type (PAIR_LOSSES), its mean the batch's loss:
    sigmoid, hinge, ipo (scores / lengths), robust, exo_pair (eps > 0), nca_pair, bco_pair, sppo_hard,
    aot / aot_unpaired (sorted over the batch: the whole global batch must be given, or the result
    depends on how pairs are split over micro-batches and ranks), apo_zero, apo_down, discopop (tau),
    sigmoid_norm (scores / lengths); the f-divergences apply to the types in F_DIVERGENCE_TYPES only.
wpo_weights(): WPO's per-answer weight; a pair's loss times weight_c * weight_r (not with aot).
simpo_loss(): CPO's simpo with label_smoothing (TRL applies it; dpo.py's simpo ignores it).

Policy gradient (TRL's GRPOTrainer): policy_loss() for bnpo (a token mean over the micro-batch given:
layout-dependent, as TRL's), cispo (REINFORCE on log-probs with the ratio clamped at eps_high and
detached; normalised as dapo) and sapo (a soft sigmoid gate instead of the clip; aggregated as grpo).
kl_sums() and clip_sums() give what TRL logs as kl (k3, times the ratio with kl_ratio) and
clip_ratio/* (a token mean at token level; at sequence level, rows counted), as sums to reduce.
Entropy (verl's entropy_coeff, grpo.py's): logprobs_and_entropy() from the full logits, aggregate() a
per-token term normalised as each loss type's surrogate (loss = pg_loss - entropy_coeff x the entropy's).
"""
import math

import torch
import torch.nn.functional as F

PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
               "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")
POLICY_LOSSES = ("bnpo", "cispo", "sapo")


# ----------------------------------------------------------------------------- preference pairs

def f_scores(logratio, divergence="reverse_kl", alpha=0.5):
    """f'(pi / ref) of a log-ratio: the score f-DPO compares (reverse_kl: the log-ratio itself)."""
    if divergence == "reverse_kl":
        return logratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-logratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    if divergence == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:  # the limit: log t
            return logratio
        t = ((alpha - 1.0) * logratio).float().clamp(max=80.0)  # TRL's clamp (fp32 / bf16)
        return (torch.exp(t) - 1.0).to(logratio.dtype) / (alpha - 1.0)
    raise ValueError(f"divergence={divergence!r}: choose one of {', '.join(F_DIVERGENCES)}")


def pair_losses(pc, pr, rc, rr, lc, lr, loss_type="sigmoid", beta=0.1, eps=0.0, tau=0.05,
                divergence="reverse_kl", alpha=0.5):
    """Per-pair losses (B,) of TRL's DPO loss type (PAIR_LOSSES); eps = label_smoothing (robust, exo_pair,
    aot), tau = discopop_tau, divergence / alpha = f_divergence_type / f_alpha_divergence_coef."""
    if divergence != "reverse_kl" and loss_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"divergence={divergence!r} applies to {', '.join(F_DIVERGENCE_TYPES)} only, not {loss_type!r}")
    dc, dr = pc - rc, pr - rr
    sc, sr = f_scores(dc, divergence, alpha), f_scores(dr, divergence, alpha)
    z = beta * (sc - sr)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (sc / lc.clamp(min=1) - sr / lr.clamp(min=1) - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "exo_pair":  # EXO (2402.00856 eq. 16): KL(softmax over the pair || [1 - eps, eps])
        if not 0 < eps < 1:
            raise ValueError("exo_pair needs 0 < label_smoothing < 1 (the paper: 1e-3)")
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * dc) - 0.5 * F.logsigmoid(-beta * dc) - 0.5 * F.logsigmoid(-beta * dr)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * dc) - F.logsigmoid(-beta * dr)
    if loss_type == "sppo_hard":
        return (dc - 0.5 / beta) ** 2 + (dr + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):  # sorted over the batch (the pairs lose their order)
        if loss_type == "aot":
            d = torch.sort(pc - pr, dim=0)[0] - torch.sort(rc - rr, dim=0)[0]
        else:
            d = torch.sort(dc, dim=0)[0] - torch.sort(dr, dim=0)[0]
        return -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * dc) + torch.sigmoid(beta * dr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * dc) + 1 - torch.sigmoid(beta * (dc - dr))
    if loss_type == "discopop":  # DiscoPOP (2406.08414 eq. 5): logistic and exponential, mixed by sigmoid(z / tau)
        mix = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (sc / lc.clamp(min=1) - sr / lr.clamp(min=1)))
    raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(PAIR_LOSSES)}")


@torch.no_grad()
def wpo_weights(logp, log_sum_sq, mask):
    """WPO (2406.11827 eq. 2): per answer, exp(the token mean of log p(y_t) - log sum_v p_v^2), no gradient.
    logp, log_sum_sq, mask (B, T): the answers' token log-probs under the policy, the log of the sum of
    its squared next-token probabilities (torch.logsumexp(2 * log_softmax(logits), -1)), which count."""
    mask = mask.to(logp.dtype)
    return torch.exp(((logp - log_sum_sq) * mask).sum(-1) / mask.sum(-1).clamp(min=1))


def simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=0.5, eps=0.0):
    """TRL's CPO simpo with label smoothing eps: z = beta (pc / lc - pr / lr) - gamma,
    -(1 - eps) log s(z) - eps log s(-z) (eps = 0: dpo.py's simpo)."""
    z = beta * (pc / lc - pr / lr) - gamma
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


# ----------------------------------------------------------------------------- policy gradient

def policy_loss(logp, old_logp, adv, mask, *, loss_type="bnpo", eps_low=0.2, eps_high=None, beta=0.0,
                ref_logp=None, kl_ratio=True, level="token", tau_pos=1.0, tau_neg=1.05, n_seqs=None, n_tokens=None):
    """The loss of one micro-batch for TRL's bnpo, cispo or sapo, as grpo.policy_loss's arguments (B, N):
    bnpo     -min(ratio A, clip(ratio) A), summed / this micro-batch's tokens (TRL: over the local batch)
    cispo    -min(ratio, eps_high).detach() A logp (eps_high an absolute cap: ScaleRL's 5.0), summed /
             n_tokens (the step's tokens, as dapo; default: this batch's)
    sapo     -(4 / tau) sigmoid(tau (ratio - 1)) A, tau = tau_pos where A > 0 else tau_neg; per completion
             a token mean, then summed / n_seqs (default: this batch's rows), as grpo
    + beta k3 to the reference (times the ratio with kl_ratio) in every token."""
    mask = mask.to(logp.dtype)
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio = logp - old_logp
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    elif level != "token":
        raise ValueError(f"level={level!r} must be token or sequence")
    ratio = log_ratio.exp()
    A = adv[:, None].to(ratio.dtype)
    if loss_type == "bnpo":
        per_token = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    elif loss_type == "cispo":
        per_token = -ratio.clamp(max=eps_high).detach() * A * logp
    elif loss_type == "sapo":
        tau = torch.where(A > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    else:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {', '.join(POLICY_LOSSES)}")
    if beta:
        d = ref_logp - logp
        kl = d.exp() - d - 1
        per_token = per_token + beta * (kl * ratio if kl_ratio else kl)
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "cispo":
        return (per_token * mask).sum() / (mask.sum().clamp(min=1.0) if n_tokens is None else n_tokens)
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / (logp.shape[0] if n_seqs is None else n_seqs)


@torch.no_grad()
def kl_sums(logp, ref_logp, mask, ratio=None):
    """(sum, count) of what TRL logs as kl: k3 per counted token, times the ratio (B, N) or (B, 1) when given
    (kl_ratio, TRL's use_bias_correction_kl); kl = the sums over every micro-batch and rank, divided."""
    d = ref_logp - logp
    kl = d.exp() - d - 1
    if ratio is not None:
        kl = kl * ratio
    mask = mask.to(kl.dtype)
    return torch.stack([(kl * mask).sum(), mask.sum()])


@torch.no_grad()
def clip_sums(ratio, adv, mask, eps_low=0.2, eps_high=None):
    """(low, high, region, count) sums of TRL's clip_ratio/low_mean, high_mean, region_mean: where the clip
    binds (ratio < 1 - eps_low with A < 0; ratio > 1 + eps_high with A > 0). ratio (B, N): counted per
    token of the mask; ratio (B, 1) (sequence level): per row, every row counted (as TRL)."""
    eps_high = eps_low if eps_high is None else eps_high
    A = adv[:, None]
    low, high = (ratio < 1 - eps_low) & (A < 0), (ratio > 1 + eps_high) & (A > 0)
    flags = torch.stack([low, high, low | high]).to(ratio.dtype)
    if ratio.shape[1] == 1:
        return torch.cat([flags.flatten(1).sum(-1), torch.tensor([float(ratio.shape[0])], dtype=ratio.dtype)])
    mask = mask.to(ratio.dtype)
    return torch.cat([(flags * mask).flatten(1).sum(-1), mask.sum()[None]])


# ----------------------------------------------------------------------------- entropy (verl's entropy_coeff)

def logprobs_and_entropy(fwd, tokens, mask, start, temperature=1.0):
    """grpo.token_logprobs's log-probs (R, S - start) and each position's entropy of softmax(logits / temperature),
    both from fwd's full logits in fp32 (verl's entropy_from_logits: a (R, S, vocab) tensor), 0 where mask is False."""
    logits = fwd(tokens[:, :-1], attn_mask=mask[:, :-1])[:, start - 1:]
    logp, m = torch.log_softmax(logits.float() / temperature, -1), mask[:, start:]
    return logp.gather(-1, tokens[:, start:, None]).squeeze(-1) * m, -(logp.exp() * logp).sum(-1) * m


def aggregate(per_token, mask, loss_type="dapo", n_seqs=None, n_tokens=None, max_len=None):
    """A per-token term (B, N) reduced over mask as grpo.policy_loss reduces loss_type's surrogate (verl's
    agg_loss of the entropy): grpo, sapo: a token mean per completion, summed / n_seqs; dapo, cispo: summed /
    n_tokens; dr_grpo: summed / (n_seqs x max_len). The normalisers default to this batch's."""
    mask = mask.to(per_token.dtype)
    n_seqs = per_token.shape[0] if n_seqs is None else n_seqs
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seqs
    if loss_type in ("dapo", "cispo"):
        return (per_token * mask).sum() / (mask.sum().clamp(min=1.0) if n_tokens is None else n_tokens)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (n_seqs * (per_token.shape[1] if max_len is None else max_len))
    raise ValueError(f"loss_type={loss_type!r}: choose one of grpo, dapo, dr_grpo, cispo, sapo")
