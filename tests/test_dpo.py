"""dpo.py: its losses and metrics against hand-computed values and TRL, its references, its layouts.

Proves:
- golden values (beta 0.1, policy (chosen, rejected) log-probs (-10, -12), reference (-11, -11)):
  sigmoid 0.598139, cdpo (eps 0.1) 0.618139, robust (eps 0.1) 0.573139, hinge 0.8, ipo (answer
  lengths 4 and 5) 20.7025, simpo (gamma 0.5) softplus(0.51) = 0.980313, + RPO alpha 1: + 10/4;
  rewards chosen 0.1, rejected -0.1, margin 0.2, accuracy 1; policy == reference: ln 2, accuracy 0;
- the sigmoid (+ RPO) loss and its gradients equal autograd through a straightforward implementation
  (full logits, log_softmax, gather, mask, sum) on a tiny model (fp32, relative error <= 1e-5);
- TRL parity (TRL's DPOTrainer.compute_loss on tiny LLaMA folders built locally, policy and reference
  different random models): our collate gives TRL's targets, and our loss and rewards/*, logps/*
  metrics equal TRL's for sigmoid, ipo, hinge, robust and sigmoid + sft (RPO) (<= 1e-5, fp32);
- the three references (a frozen copy, the LoRA policy with adapters off, log-probs precomputed by
  the untrained policy) give the same log-probs, loss and training step; the reference never
  receives a gradient and the frozen base never changes; the adapters are back on afterwards;
- layouts (gloo, one 2-process spawn, 3 steps, two accumulated micro-steps per rank): DP2 (copy,
  sigmoid + RPO), FSDP2 (precomputed, ipo), TP2 (copy, robust: vocab-parallel log-probs) and LoRA
  under DP2 (adapters off) equal one process: weights (adapters) after 3 steps, and every step's
  metrics reduced over ranks and gradient norm (relative error <= 1e-5);
- resume (main() end to end, one process): 2 steps + resume to 4 equals 4 uninterrupted steps for
  the frozen copy and for LoRA's adapters off (bitwise) and for precomputed log-probs (read back from
  out_dir/ref_logps.pt), with the same logged metrics; held-out rewards/accuracies 0 and loss ln 2 at
  step 0; a resume whose reference is not the one DPO started with is refused;
- data: truncation keeps the prompt and cuts answers (counted), skips a prompt with no room, an
  empty answer and answers identical after the cut (counted); chat_data's bad records (chosen ==
  rejected, text vs messages, an empty answer) stop the run naming file:line, or are skipped and
  counted; bad settings raise one clear error.
"""
import contextlib
import json
import math
import os
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from distributed import assert_close, spawn, train_cfg
from safetensors.torch import load_file

import chat
import checkpoint
import config
import dpo
import lora
import parallel
import weights
from model import IGNORE, ModelConfig, Transformer

V, N = 97, 24
SMALL = {**dpo.EXTRA, **dict(vocab_size=V, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                              block_size=32, batch_size=8, micro_batch_size=2, lr=1e-2, weight_decay=0.1, grad_clip=0.5,
                              eps=1e-4, warmup_steps=0, schedule="constant", seed=0)}


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def one_grid():
    return parallel.init(small_cfg())


def random_seqs(n=N, seed=0):
    """n pairs of random ids: prompts of 2-6 tokens, answers of 1-6 (chosen != rejected)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(0, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return [(ids(2, 7), ids(1, 7), [V - 1] + ids(0, 6)) for _ in range(n)]


# ----------------------------------------------------------------------------- golden values

def golden(loss_type, rpo_alpha=0.0, policy=(-10.0, -12.0), eps=None):
    eps = (0.1 if loss_type in ("robust", "cdpo") else 0.0) if eps is None else eps  # the types that read it
    cfg = SimpleNamespace(loss_type=loss_type, beta=0.1, label_smoothing=eps, simpo_gamma=0.5, rpo_alpha=rpo_alpha,
                          f_divergence="reverse_kl")
    logps, ref = torch.tensor(policy, dtype=torch.float64), torch.tensor([-11.0, -11.0], dtype=torch.float64)
    loss, sums = dpo.objective(logps, ref, torch.tensor([4, 5]), cfg, n_pairs=1, n_tokens=4)  # answer lengths 4, 5
    return loss.item(), dpo.metrics(sums, rpo_alpha=rpo_alpha)


@pytest.mark.parametrize("loss_type, want", [("sigmoid", 0.598139), ("cdpo", 0.618139), ("robust", 0.573139),
                                             ("hinge", 0.8), ("ipo", 20.7025), ("simpo", 0.980313)])
def test_golden_losses(loss_type, want):
    loss, m = golden(loss_type)
    assert abs(loss - want) < 1e-6 and abs(m["loss"] - want) < 1e-6
    if loss_type != "simpo":
        assert m["rewards/chosen"] == pytest.approx(0.1) and m["rewards/rejected"] == pytest.approx(-0.1)
        assert m["rewards/margins"] == pytest.approx(0.2) and m["rewards/accuracies"] == 1.0
    else:  # reference-free: beta * mean token log-prob, -0.25 and -0.24
        assert m["rewards/chosen"] == pytest.approx(-0.25) and m["rewards/rejected"] == pytest.approx(-0.24)
        assert m["rewards/accuracies"] == 0.0
    assert m["logps/chosen"] == -10.0 and m["logps/rejected"] == -12.0 and m["policy/accuracy"] == 1.0


def test_golden_simpo_label_smoothing():
    """TRL's CPO simpo with eps = 0.1: z = 0.1 (-10/4 + 12/5) - 0.5 = -0.51,
    0.9 log(1 + e^0.51) + 0.1 log(1 + e^-0.51) = 0.9 * 0.980313 + 0.1 * 0.470314 = 0.929313."""
    loss, _ = golden("simpo", eps=0.1)
    assert abs(loss - 0.929313) < 1e-6


def test_golden_rpo_and_policy_equal_reference():
    loss, m = golden("sigmoid", rpo_alpha=1.0)
    assert abs(loss - (0.598139 + 10 / 4)) < 1e-6 and m["nll"] == 2.5 and abs(m["loss"] - loss) < 1e-12
    loss, m = golden("sigmoid", policy=(-11.0, -11.0))
    assert abs(loss - math.log(2)) < 1e-12 and abs(0.693147 - loss) < 1e-6
    assert m["rewards/accuracies"] == 0.0 and m["rewards/chosen"] == 0.0 and m["rewards/margins"] == 0.0


# ----------------------------------------------------------------------------- gradients

def straightforward(model, ref_model, x, y, beta, rpo_alpha):
    """DPO as a reader would write it: full logits, log_softmax, gather the targets, mask, sum."""
    def seq(m):
        lp = m(x).float().log_softmax(-1).gather(-1, y.clamp(min=0)[..., None]).squeeze(-1)
        return (lp * (y != IGNORE)).sum(-1), lp
    (pol, lp), (ref, _) = seq(model), seq(ref_model)
    pc, pr = pol.chunk(2)
    rc, rr = ref.detach().chunk(2)
    loss = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    chosen = (y != IGNORE).chunk(2)[0]
    return loss - rpo_alpha * lp.chunk(2)[0][chosen].mean(), pol


@pytest.mark.parametrize("rpo_alpha", [0.0, 0.5])
def test_sigmoid_gradients_equal_straightforward(one_thread, rpo_alpha):
    cfg = small_cfg(rpo_alpha=rpo_alpha)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    torch.manual_seed(1)
    ref_model = Transformer(ModelConfig.from_cfg(cfg)).requires_grad_(False)
    seqs = random_seqs(4)
    x, y = dpo.collate(seqs)
    ref = dpo.sequence_logps(ref_model, x, y)
    loss, _ = dpo.objective(dpo.sequence_logps(model, x, y), ref, (y != IGNORE).sum(-1), cfg, 4,
                            sum(len(c) for _, c, _ in seqs))
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, pol = straightforward(model, ref_model, x, y, cfg.beta, rpo_alpha)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    assert_close(dpo.sequence_logps(model, x, y), pol, "sequence log-probs")
    assert_close(ours, {n: p.grad for n, p in model.named_parameters()}, "gradients")


# ----------------------------------------------------------------------------- TRL parity

@pytest.fixture(scope="module")
def trl_case(tmp_path_factory):
    """A word-level tokenizer, two random tiny LLaMA folders (policy, reference), string pairs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("trl")
    transformers.logging.set_verbosity_error()
    words = ["<eos>", "<pad>"] + [f"w{i}" for i in range(58)]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        conf = transformers.LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        initializer_range=0.2, bos_token_id=None, eos_token_id=0, pad_token_id=1)
        path = tmp_path_factory.mktemp(f"llama{seed}")
        transformers.LlamaForCausalLM(conf).save_pretrained(path)
        folders.append(str(path))
    g = torch.Generator().manual_seed(2)
    text = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(2, 58, (n,), generator=g))  # noqa: E731
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for n in (3, 5, 2, 6):
        rows["prompt"].append(text(n) + " ")
        rows["chosen"].append(text(n % 4 + 1))
        rows["rejected"].append(text(7 - n % 4))
    return tok, folders, rows


@pytest.mark.parametrize("loss_types, weights, eps", [(["sigmoid"], None, 0.0), (["ipo"], None, 0.0),
                                                      (["hinge"], None, 0.0), (["robust"], None, 0.1),
                                                      (["sigmoid", "sft"], [1.0, 0.5], 0.0)])
def test_trl_parity(trl_case, tmp_path, loss_types, weights, eps):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    import hf
    tok, (pol_dir, ref_dir), rows = trl_case
    args = DPOConfig(output_dir=str(tmp_path), beta=0.1, loss_type=loss_types, loss_weights=weights,
                     label_smoothing=eps, max_length=None, bf16=False, use_cpu=True, gradient_checkpointing=False,
                     report_to="none", dataset_num_proc=None)
    assert args.truncation_mode == "keep_start" and DPOConfig(str(tmp_path), use_cpu=True, bf16=False).loss_type == ["sigmoid"]
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(pol_dir), args=args,
                         ref_model=AutoModelForCausalLM.from_pretrained(ref_dir),
                         train_dataset=Dataset.from_dict(rows), processing_class=tok)
    examples = [trainer.train_dataset[i] for i in range(len(rows["prompt"]))]
    batch = trainer.data_collator(examples)
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.compute_loss(trainer.model, batch).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}

    seqs = [(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
    x, y = dpo.collate(seqs)
    ids, cm = batch["input_ids"], batch["completion_mask"]
    assert torch.equal(y, ids[:, 1:].masked_fill(cm[:, 1:] == 0, IGNORE)[:, :y.shape[1]])  # TRL's targets
    cfg = SimpleNamespace(loss_type=loss_types[0], beta=0.1, label_smoothing=eps, simpo_gamma=0.5,
                          rpo_alpha=weights[1] if weights else 0.0, f_divergence="reverse_kl")
    with torch.no_grad():
        logps = dpo.sequence_logps(hf.load_hf(pol_dir), x, y)
        ref = dpo.sequence_logps(hf.load_hf(ref_dir), x, y)
    loss, sums = dpo.objective(logps, ref, (y != IGNORE).sum(-1), cfg, len(seqs), sum(len(s[1]) for s in seqs))
    ours = dpo.metrics(sums, rpo_alpha=cfg.rpo_alpha)
    assert abs(loss.item() - want) <= 1e-5 * max(1.0, abs(want)) and abs(ours["loss"] - want) <= 1e-5 * max(1, abs(want))
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected"):
        assert abs(ours[k] - trl_metrics[k]) <= 1e-5 * max(1.0, abs(trl_metrics[k])), (k, ours[k], trl_metrics[k])
    assert 0 < ours["rewards/accuracies"] < 1  # the case is not degenerate: the comparison can fail


# ----------------------------------------------------------------------------- the three references

def random_adapters(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if lora.is_adapter(n)}


def test_references_agree_and_get_no_gradient(one_thread):
    cfg, grid, nothing = small_cfg(lora_r=4), one_grid(), contextlib.nullcontext()
    seqs = random_seqs()
    run = weights.build_net(cfg, grid)  # fresh adapters: the policy still equals its base
    table = dpo.policy_logps(run, seqs, range(N), cfg, grid, nothing)
    lora.load(run.raw, grid, random_adapters(run.raw, 3))  # now it does not
    base = {n: p.clone() for n, p in run.raw.named_parameters() if not lora.is_adapter(n)}
    refs = {k: dpo.make_reference(k, cfg, grid, run, seqs, nothing, table if k == "precomputed" else None)
            for k in ("copy", "adapters", "precomputed")}
    ids = [3, 7, 11]
    x, y = dpo.collate([seqs[i] for i in ids])
    got = {k: f(x, y, ids) for k, f in refs.items()}
    for k in ("adapters", "precomputed"):
        assert_close(got[k], got["copy"], f"reference {k}", tol=1e-6)
    policy = dpo.sequence_logps(run.fwd, x, y)
    assert (policy - got["copy"]).abs().max() > 0.1  # adapters on again after lora.disabled
    losses = {k: dpo.objective(policy, v, (y != IGNORE).sum(-1), cfg, 3, 9)[0] for k, v in got.items()}
    assert max(abs(v.item() - losses["copy"].item()) for v in losses.values()) <= 1e-6
    adapters = {}
    for k, f in refs.items():  # one training step with each: the same adapters
        lora.load(run.raw, grid, random_adapters(run.raw, 3))
        run.optimizer.state.clear()
        dpo.train_step(run, f, seqs, dpo.step_indices(0, N, cfg.batch_size, cfg.seed), cfg, grid, nothing)
        adapters[k] = lora.gather(run.raw, grid)
    for k in ("adapters", "precomputed"):
        assert_close(adapters[k], adapters["copy"], f"step with reference {k}", tol=1e-6)
    copy = refs["copy"].model
    assert all(not p.requires_grad and p.grad is None for p in copy.parameters())
    assert all(torch.equal(copy.state_dict()[n], v) for n, v in base.items())  # the copy is the base
    assert all(torch.equal(p, base[n]) and p.grad is None for n, p in run.raw.named_parameters() if n in base)


# ----------------------------------------------------------------------------- layouts

LAYOUTS = {  # name -> (cfg overrides, reference)
    "dp2": (dict(rpo_alpha=0.5), "copy"),
    "fsdp2": (dict(data_parallel="fsdp", loss_type="ipo"), "precomputed"),
    "tp2": (dict(tp=2, loss_type="robust", label_smoothing=0.1), "copy"),
    "lora_dp2": (dict(lora_r=4), "adapters"),
}
STEPS = 3


def train(name, grid=None):
    """STEPS DPO steps of layout `name` (grid None: one process) -> weights (or adapters), metrics."""
    kw, kind = LAYOUTS[name]
    cfg = small_cfg(**kw) if grid else small_cfg(**{k: v for k, v in kw.items() if k not in ("tp", "data_parallel")})
    grid = grid or one_grid()
    if cfg.tp > 1 or cfg.data_parallel != "ddp":
        grid = parallel.init(cfg)
    seqs, nothing = random_seqs(), contextlib.nullcontext()
    run = weights.build_net(cfg, grid)
    reference = dpo.make_reference(kind, cfg, grid, run, seqs, nothing)
    rec = {"metrics": [], "norms": []}
    for s in range(STEPS):
        sums, norm = dpo.train_step(run, reference, seqs, dpo.step_indices(s, N, cfg.batch_size, cfg.seed), cfg,
                                    grid, nothing)
        rec["metrics"].append(torch.tensor(list(dpo.metrics(sums, grid.data_group).values())))
        rec["norms"].append(norm.reshape(1))
    rec["weights"] = (lora.gather(run.raw, grid, run.wrapper) if cfg.lora_r else
                      run.full_state(optimizer=False)[0])
    return rec


def _layouts(rank, out_dir):
    for name in LAYOUTS:
        torch.save(train(name, parallel.init(small_cfg())), os.path.join(out_dir, f"{name}_{rank}.pt"))


def test_layouts_equal_one_process(tmp_path, one_thread):
    spawn(_layouts, 2, str(tmp_path))
    for name in LAYOUTS:
        ref = train(name)
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}_{rank}.pt")
            assert_close(got["weights"], ref["weights"], f"{name} rank {rank} weights")
            assert_close(torch.stack(got["metrics"]), torch.stack(ref["metrics"]), f"{name} metrics")
            assert_close(torch.cat(got["norms"]), torch.cat(ref["norms"]), f"{name} grad norms")


# ----------------------------------------------------------------------------- data and settings

def fake_encode(messages, gen):
    """ids: one per character of 'role:content|'; mask: assistant content and its '|'."""
    ids, mask = [], []
    for m in messages:
        head, body = [ord(c) for c in m["role"] + ":"], [ord(c) for c in m["content"] + "|"]
        ids += head + body
        mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    if gen:
        ids += [ord(c) for c in "assistant:"]
    return ids, mask + [False] * (len(ids) - len(mask))


def test_tokenize_truncation_policy():
    user = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    bot = lambda t: [{"role": "assistant", "content": t}]  # noqa: E731
    pairs = [(user("ab"), bot("yes"), bot("no")),               # fits: prompt 'user:ab|assistant:' = 18
             (user("a" * 20), bot("x"), bot("y")),               # prompt 37 > T: skipped
             (user("ab"), bot("long answer"), bot("no")),        # chosen cut to T + 1 - 18 = 5 tokens
             (user("ab"), bot("same-1"), bot("same-2")),         # identical after the cut: skipped
             (user("ab"), bot(""), bot("no"))]                   # '|' only: kept (an answer of one token)
    out, counts = dpo.tokenize(pairs, fake_encode, T=22)
    assert counts == Counter({"prompt longer than seq_len": 1, "answers cut to seq_len": 1,  # each pair once
                              "chosen == rejected tokens (after the cut)": 1})
    assert len(out) == 3 and all(len(p) == 18 and len(p) + max(len(c), len(r)) <= 23 for p, c, r in out)
    assert [chr(i) for i in out[0][1]] == list("yes|") and [chr(i) for i in out[1][1]] == list("long ")
    empty, counts = dpo.tokenize([(user("ab"), [], bot("no"))], fake_encode, T=22)
    assert empty == [] and counts == Counter({"empty answer": 1})


@pytest.mark.parametrize("kw, msg", [(dict(loss_type="dpo"), "loss_type='dpo'"),
                                     (dict(reference="adapters"), "set lora_r > 0"),
                                     (dict(label_smoothing=0.5), "label_smoothing=0.5"),
                                     (dict(beta=0.0), "beta=0.0 must be > 0"),
                                     (dict(task="", n_pairs=0), "no pairs: set chat_data")])
def test_bad_settings(kw, msg):
    with pytest.raises(config.ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        dpo.check(small_cfg(**kw))
    assert dpo.check(small_cfg()) == "copy" and dpo.check(small_cfg(lora_r=4)) == "adapters"
    assert dpo.check(small_cfg(loss_type="simpo")) == "none"


def test_read_pairs_bad_records(tmp_path):
    good = {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}
    bad = [{"prompt": "p", "chosen": "same", "rejected": "same"}, {"prompt": "p", "chosen": "a", "rejected": []},
           {"prompt": "p", "chosen": " ", "rejected": "b"}]
    file = tmp_path / "pairs.jsonl"
    file.write_text("\n".join(json.dumps(r) for r in [good] * 3 + bad + [good]) + "\n")
    cfg = small_cfg(chat_data=str(file), eval_pairs=1)
    with pytest.raises(chat.ChatDataError, match=r"pairs.jsonl:4: chosen and rejected are the same answer"):
        dpo.read_pairs(cfg)
    cfg.skip_bad_records = True
    train, held, skipped = dpo.read_pairs(cfg)
    assert len(train) == 3 and len(held) == 1 and skipped == Counter(same_answers=1, mismatched=1, empty_answer=1)
    assert train[0] == ([{"role": "user", "content": good["prompt"]}], [{"role": "assistant", "content": "2"}],
                        [{"role": "assistant", "content": "3"}])


# ----------------------------------------------------------------------------- main: resume

MAIN = dict(device="cpu", tokenizer_vocab=300, n_layer=2, n_head=2, n_embd=32, block_size=32, n_pairs=32,
            eval_pairs=8, batch_size=8, micro_batch_size=4, max_steps=4, warmup_steps=0, lr=1e-2, eval_every=2,
            ckpt_every=2, log_every=1, keep_last=5, progress=False)


def main(out, **kw):
    dpo.main([f"--{k}={v}" for k, v in {**MAIN, "out_dir": out, **kw}.items()])


def steps(out):
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        return {(r["step"], "loss" in r): r for r in map(json.loads, f)}


def test_main_resume_restores_the_reference(tmp_path, one_thread, capsys):
    """Uninterrupted 4 steps == 2 steps, then resumed to 4, for the three references (copy and LoRA's
    adapters off: bitwise; precomputed: from its cache), so a resumed run trains against the
    reference DPO started with. A reference that is not the start's (here: init_from a trained
    policy, as if rebuilt from the resumed policy) is refused on resume."""
    a, b, c, d, e = (str(tmp_path / n) for n in "abcde")
    main(a)
    summary = capsys.readouterr().out.strip().splitlines()[-1]  # the stage's one closing line
    assert re.fullmatch(r"DPO done: 4 steps in [0-9.]+ min \| held-out policy accuracy \(prefers the chosen answer\) "
                        r"[0-9.]+% \(step 0\) -> [0-9.]+% \(step 4\) \| final checkpoint .*step_000004", summary), summary
    main(d, lora_r=4)
    for out, kw in ((b, dict(reference="copy")), (c, dict(reference="precomputed")), (e, dict(lora_r=4))):
        main(out, stop_at=2, **kw)
        main(out, resume="latest", **kw)
    assert "reference log-probs of 40 pairs read from" in capsys.readouterr().out

    def weights(out):
        return load_file(os.path.join(out, "step_000004", "model.safetensors"))
    for out, want in ((b, a), (e, d)):
        assert all(torch.equal(v, weights(want)[k]) for k, v in weights(out).items()), out
    assert_close(weights(c), weights(a), "precomputed")
    assert any(lora.is_adapter(k) for k in weights(e))
    ref, resumed = steps(a), steps(b)
    assert ref.keys() == resumed.keys() and len(ref) == 7  # steps 1-4, evaluations at 0, 2, 4
    for k, r in ref.items():
        assert all(v == resumed[k][n] for n, v in r.items() if n not in ("time", "pairs_s", "mem_gb")), k
    assert ref[(0, False)]["eval_rewards/accuracies"] == 0 and ref[(0, False)]["eval_loss"] == pytest.approx(math.log(2))
    main(b, stop_at=2, overwrite=True)
    with pytest.raises(checkpoint.ResumeMismatch, match="the reference differs from the one this run started with"):
        main(b, resume="latest", init_from=os.path.join(a, "step_000004"))


def test_trl_types_and_smoothing_settings():
    """TRL's other pair-local loss types run through dpo.objective as objectives.pair_losses computes them
    (objectives' tests hold them to TRL's trainers); simpo applies label_smoothing as TRL's CPO does;
    label_smoothing on a type that ignores it, and layout-dependent types, are refused in one line."""
    from posttrain import objectives
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g) for _ in range(4))
    lc, lr = torch.tensor([3., 4, 5, 6, 7, 8]), torch.tensor([2., 4, 6, 8, 9, 3])
    for kind in ("exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop", "sigmoid_norm"):
        eps = 1e-3 if kind == "exo_pair" else 0.0
        assert torch.equal(dpo.pair_losses(pc, pr, rc, rr, lc, lr, kind, 0.1, eps),
                           objectives.pair_losses(pc, pr, rc, rr, lc, lr, kind, 0.1, eps)), kind
    z = 2.0 * (pc / lc - pr / lr) - 0.5
    want = -0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)
    assert torch.allclose(dpo.pair_losses(pc, pr, rc, rr, lc, lr, "simpo", 2.0, 0.1, 0.5), want)
    fwd = dpo.pair_losses(pc, pr, rc, rr, lc, lr, "sigmoid", 0.1, divergence="forward_kl")
    assert torch.equal(fwd, objectives.pair_losses(pc, pr, rc, rr, lc, lr, "sigmoid", 0.1, divergence="forward_kl"))
    for kw, match in [(dict(loss_type="sigmoid", label_smoothing=0.1), "does not read it"),
                      (dict(loss_type="aot"), "choose one of"), (dict(loss_type="exo_pair"), "needs label_smoothing"),
                      (dict(loss_type="nca_pair", f_divergence="forward_kl"), "only with")]:
        with pytest.raises(config.ConfigError, match=match):
            dpo.check(small_cfg(**kw))
