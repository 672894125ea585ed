"""objectives.py: TRL's other DPO and GRPO objectives, equal to TRL 1.16's own code on the same inputs.

Proves (tiny random LLaMA folders built locally, word-level tokenizer, no hub, fp32):
- DPO: DPOTrainer.compute_loss (one trainer; its loss_types / label_smoothing / f_divergence_type /
  f_alpha_divergence_coef / use_weighting / discopop_tau set between calls) equals the mean of
  objectives.pair_losses on sequence log-probs computed here from the two models (log_softmax, gather,
  sum over the answer), for every loss type of PAIR_LOSSES, each f-divergence on the types TRL allows,
  and WPO weights (logsumexp of 2 log_softmax) on three types: |ours - TRL| <= 1e-5 (relative above 1);
- CPO's simpo with label smoothing: TRL's CPOTrainer.cpo_loss on given averaged log-probs;
- GRPO: GRPOTrainer._compute_loss for bnpo, cispo and sapo on a hand-built batch (ragged completions,
  old and reference log-probs off the policy's, token and sequence ratios, beta 0 and 0.04, with and
  without the ratio on the KL) equals objectives.policy_loss on the policy log-probs TRL's own path
  gives: loss within 1e-5 and the gradients of the embedding and head within 1e-5 relative; and what
  TRL logs (kl, clip_ratio/low_mean, high_mean, region_mean; cispo_clip_ratio) equals kl_sums /
  clip_sums (a token mean at token level, rows counted at sequence level).
The cases are not degenerate: rewards/accuracies strictly between 0 and 1, and some ratios clipped.
"""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from posttrain import objectives

V = 40


def word_tokenizer(transformers, tokenizers, words, eos, pad):
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[2]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token=pad)


def llama(transformers, path, seed, eos, pad, vocab):
    torch.manual_seed(seed)
    conf = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    initializer_range=0.2, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    transformers.LlamaForCausalLM(conf).save_pretrained(path)
    return str(path)


def close(a, b, what):
    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{what}: ours {a} TRL {b}"


# ----------------------------------------------------------------------------- DPO

@pytest.fixture(scope="module")
def dpo_case(tmp_path_factory):
    """A DPOTrainer (use_weighting on, so its model also returns log sum p^2), its collated batch, and our
    inputs: pc, pr, rc, rr, lc, lr and the policy's per-token log-probs and log sum p^2."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    transformers.logging.set_verbosity_error()
    words = ["<eos>", "<pad>"] + [f"w{i}" for i in range(V - 2)]
    tok = word_tokenizer(transformers, tokenizers, words, "<eos>", "<pad>")
    pol_dir, ref_dir = (llama(transformers, tmp_path_factory.mktemp(f"m{s}"), s, 0, 1, V) for s in (0, 1))
    g = torch.Generator().manual_seed(2)
    text = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(2, V - 2, (n,), generator=g))  # noqa: E731
    rows = {"prompt": [text(n) + " " for n in (3, 5, 2, 6, 4, 3)],
            "chosen": [text(n) for n in (1, 2, 3, 4, 2, 5)], "rejected": [text(n) for n in (4, 3, 2, 1, 5, 2)]}
    load = transformers.AutoModelForCausalLM.from_pretrained
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("out")), beta=0.1, loss_type=["sigmoid"], use_weighting=True,
                     max_length=None, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
                     dataset_num_proc=None)
    trainer = DPOTrainer(model=load(pol_dir), args=args, ref_model=load(ref_dir), train_dataset=Dataset.from_dict(rows),
                         processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows["prompt"]))])
    trainer.model.eval()
    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"][:, 1:]
    seqs, per_token = [], None
    with torch.no_grad():
        for path in (pol_dir, ref_dir):
            lp = F.log_softmax(load(path)(input_ids=ids, attention_mask=am).logits[:, :-1].double(), -1)
            tok_lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1) * cm
            seqs.append(tok_lp.sum(-1))
            per_token = per_token or (tok_lp, torch.logsumexp(2 * lp, -1))
    (pc, pr), (rc, rr), (lc, lr) = seqs[0].chunk(2), seqs[1].chunk(2), cm.sum(-1).double().chunk(2)
    return trainer, batch, (pc, pr, rc, rr, lc, lr), per_token, cm


CASES = [(lt, 0.0, "reverse_kl", 0.5, False, 0.05) for lt in objectives.PAIR_LOSSES if lt not in ("robust", "exo_pair")]
CASES += [("robust", 0.1, "reverse_kl", 0.5, False, 0.05), ("exo_pair", 1e-3, "reverse_kl", 0.5, False, 0.05),
          ("exo_pair", 0.2, "reverse_kl", 0.5, False, 0.05), ("aot", 0.1, "reverse_kl", 0.5, False, 0.05),
          ("aot_unpaired", 0.2, "reverse_kl", 0.5, False, 0.05), ("discopop", 0.0, "reverse_kl", 0.5, False, 0.5)]
CASES += [(lt, 0.1 if lt in ("robust", "exo_pair") else 0.0, div, alpha, False, 0.05)
          for lt in objectives.F_DIVERGENCE_TYPES
          for div, alpha in [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5),
                             ("alpha_divergence", 2.0), ("alpha_divergence", 1.0)]]
CASES += [(lt, 0.0, "reverse_kl", 0.5, True, 0.05) for lt in ("sigmoid", "ipo", "bco_pair")]
CASES += [("sigmoid", 0.0, "forward_kl", 0.5, True, 0.05)]


@pytest.mark.parametrize("loss_type, eps, divergence, alpha, wpo, tau", CASES)
def test_dpo_losses_equal_trl(dpo_case, loss_type, eps, divergence, alpha, wpo, tau):
    trainer, batch, (pc, pr, rc, rr, lc, lr), (tok_lp, log_sum_sq), cm = dpo_case
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = [loss_type], [1.0], eps
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef, trainer.use_weighting = divergence, alpha, wpo
    trainer.args.discopop_tau = tau
    with torch.no_grad():
        want = trainer.compute_loss(trainer.model, batch).item()
    losses = objectives.pair_losses(pc, pr, rc, rr, lc, lr, loss_type, 0.1, eps, tau, divergence, alpha)
    if wpo:
        wc, wr = objectives.wpo_weights(tok_lp, log_sum_sq, cm).chunk(2)
        losses = losses * wc * wr
    close(losses.mean().item(), want, f"{loss_type} eps={eps} {divergence}({alpha}) wpo={wpo} tau={tau}")
    accuracy = trainer._metrics["eval"]["rewards/accuracies"][-1]
    assert 0 < accuracy < 1 and abs(accuracy - ((pc - rc) > (pr - rr)).double().mean().item()) < 1e-6


def test_refusals():
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="applies to .* only, not 'bco_pair'"):
        objectives.pair_losses(x, x, x, x, x + 1, x + 1, "bco_pair", divergence="js_divergence")
    with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing"):
        objectives.pair_losses(x, x, x, x, x + 1, x + 1, "exo_pair")
    with pytest.raises(ValueError, match="choose one of"):
        objectives.pair_losses(x, x, x, x, x + 1, x + 1, "kto")
    with pytest.raises(ValueError, match="choose one of bnpo, cispo, sapo"):
        objectives.policy_loss(x[:, None], x[:, None], x, x[:, None] > -1, loss_type="grpo")


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_simpo_label_smoothing_equals_trl_cpo(eps):
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    g = torch.Generator().manual_seed(3)
    pc, pr = -torch.rand(5, generator=g, dtype=torch.float64) * 30, -torch.rand(5, generator=g, dtype=torch.float64) * 30
    lc, lr = torch.tensor([3.0, 5, 2, 7, 4], dtype=torch.float64), torch.tensor([6.0, 2, 4, 3, 8], dtype=torch.float64)
    me = SimpleNamespace(alpha=0.0, beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=eps,
                         accelerator=SimpleNamespace(device="cpu"))
    want = CPOTrainer.cpo_loss(me, pc / lc, pr / lr)[0]   # CPO's simpo reads the answers' mean log-probs
    got = objectives.simpo_loss(pc, pr, lc, lr, beta=2.0, gamma=0.5, eps=eps)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- GRPO

@pytest.fixture(scope="module")
def grpo_case(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("trl")
    transformers.logging.set_verbosity_error()
    words = ["<pad>", "<eos>"] + [f"t{i}" for i in range(2, V)]
    tok = word_tokenizer(transformers, tokenizers, words, "<eos>", "<pad>")
    path = llama(transformers, tmp_path_factory.mktemp("grpo"), 0, 1, 0, V)
    B, P, C = 4, 5, 7
    g = torch.Generator().manual_seed(1)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor([5, 3, 4, 2])[:, None]).long()  # left-padded
    completion_mask = (torch.arange(C)[None] < torch.tensor([3, 7, 2, 6])[:, None]).long()
    batch = dict(prompt_ids=torch.randint(2, V, (B, P), generator=g) * prompt_mask, prompt_mask=prompt_mask,
                 completion_ids=torch.randint(2, V, (B, C), generator=g) * completion_mask,
                 completion_mask=completion_mask, advantages=torch.tensor([0.9, -1.2, 0.4, -0.3]),
                 num_items_in_batch=completion_mask.sum())
    return tok, path, batch, g


@pytest.mark.parametrize("loss_type", objectives.POLICY_LOSSES)
def test_policy_losses_and_logged_metrics_equal_trl(grpo_case, tmp_path, loss_type):
    import trl
    from datasets import Dataset
    tok, path, batch, g = grpo_case
    T = 0.7
    eps_high = 5.0 if loss_type == "cispo" else 0.28   # cispo's eps_high caps the ratio itself (ScaleRL: 5.0)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                          report_to="none", per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                          loss_type=loss_type, beta=0.04, temperature=T, epsilon=0.2, epsilon_high=eps_high)
    trainer = trl.GRPOTrainer(model=path, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["t2 t3"] * 4}), processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    C, mask = batch["completion_ids"].shape[1], batch["completion_mask"]

    def policy_logps():  # TRL's own path: the same log-probs its loss reads, with their graph
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, am, C)[0]
    with torch.no_grad():
        lp = policy_logps()
    noise = 1.5 if loss_type == "cispo" else 0.3   # cispo: ratios above its cap of 5 too
    offset = torch.tensor([-0.5, 0.5, 0.0, 0.0])[:, None]  # whole rows off too: sequence ratios clipped high, low
    old = (lp + noise * torch.randn(lp.shape, generator=g) + offset) * mask
    ref = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    adv = batch["advantages"]
    for beta, level, kr in [(0.0, "token", True), (0.0, "sequence", True), (0.04, "token", True),
                            (0.04, "sequence", True), (0.04, "token", False)]:
        case = f"{loss_type} beta={beta} {level} kl_ratio={kr}"
        trainer.beta, trainer.importance_sampling_level, args.use_bias_correction_kl = beta, level, kr
        trainer.model.zero_grad()
        theirs = trainer._compute_loss(trainer.model, dict(batch, old_per_token_logps=old, ref_per_token_logps=ref))
        theirs.backward()
        want = [p.grad.clone() for p in (trainer.model.model.embed_tokens.weight, trainer.model.lm_head.weight)]
        trainer.model.zero_grad()
        logp = policy_logps()
        mine = objectives.policy_loss(logp, old, adv, mask, loss_type=loss_type, eps_low=0.2, eps_high=eps_high,
                                      beta=beta, ref_logp=ref, kl_ratio=kr, level=level)
        mine.backward()
        assert abs(theirs.item() - mine.item()) <= 1e-5, f"{case}: TRL {theirs.item()} ours {mine.item()}"
        for a, b in zip((trainer.model.model.embed_tokens.weight.grad, trainer.model.lm_head.weight.grad), want):
            assert ((a - b).norm() / b.norm()).item() <= 1e-5, case
        # what TRL logged for this call
        logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        log_ratio = (logp - old).detach()
        if level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1))[:, None]
        ratio = log_ratio.exp()
        if beta:
            s, n = objectives.kl_sums(logp.detach(), ref, mask, ratio if kr else None)
            close((s / n).item(), logged["kl"], case + " kl")
        if loss_type == "cispo":
            flags = (ratio > eps_high) & (adv[:, None] > 0)
            counted = flags.float().sum() / ratio.shape[0] if level == "sequence" else (flags * mask).sum() / mask.sum()
            close(counted.item(), logged["cispo_clip_ratio"], case + " cispo_clip_ratio")
        if loss_type == "bnpo":
            low, high, region, n = objectives.clip_sums(ratio, adv, mask, 0.2, eps_high).tolist()
            for name, v in [("low_mean", low), ("high_mean", high), ("region_mean", region)]:
                close(v / n, logged[f"clip_ratio/{name}"], f"{case} clip_ratio/{name}")
            assert 0 < region < n, "the clip must bind on some tokens (rows), not all"
