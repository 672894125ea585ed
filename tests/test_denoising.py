"""pretrain.py's objectives mlm (BERT) and span (T5): batches, loss, layouts, resume, init_from HF folders.

Proves:
- denoising.corrupt: each row equals bert.mask_tokens / t5.span_corrupt with its own generator seeded
  by (seed, stream, global row), so a global batch corrupted in one call equals its data ranks'
  shares corrupted apart (first_row offsets); another stream gives other masks; span rows have
  read_length tokens in, inputs within seq_len, sentinels above the tokenizer's ids, [MASK] past them.
- denoising.token_mean: two micro-steps with different numbers of predicted tokens give the
  gradient of the whole batch's mean over them (fp32, <= 1e-5), not a mean of micro-batch means.
- pretrain.py end to end (subprocesses as a user runs them): objective=mlm on 2 gloo processes
  (torchrun) ends with the one-process weights (<= 1e-5) and logs its losses; objective=span
  stopped at step 2 and resumed logs exactly the uninterrupted losses and validation losses; both
  learn (the loss falls).
- init_from an HF BertForMaskedLM / T5ForConditionalGeneration folder (built here by transformers):
  weights.configure + build_model + loader give transformers' logits (<= 1e-4); objective is set
  from the folder.
- refusals, one line each: layouts and keys a BERT / T5 does not take (tp, LoRA, a decoder-only key),
  a decoder checkpoint under objective=mlm, vocabularies without room for [MASK].
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from distributed import assert_close
from safetensors.torch import load_file

import config
import parallel
import pretrain
import tokenizer
import weights
from encoders import bert, denoising, t5
from fused import IGNORE

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TOK = tokenizer.get_tokenizer("cl100k_base", 512)
SMALL = ["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
         "--batch_size=4", "--micro_batch_size=2", "--lr=3e-3", "--warmup_steps=2", "--log_every=1",
         "--progress=False", "--eval_every=3", "--eval_batches=2"]
MLM = ["--objective=mlm", "--activation=gelu", "--mask_rate=0.3"]
SPAN = ["--objective=span", "--activation=gated-gelu", "--tie_embeddings=True"]


def cfg_of(**kw):
    return SimpleNamespace(**{**config.defaults({**pretrain.EXTRA, **denoising.DENOISING_DEFAULTS}), "device": "cpu",
                              **kw})


def test_corrupt_rows_follow_the_data_not_the_split():
    ids = torch.randint(0, TOK.n_vocab, (8, 32), generator=torch.Generator().manual_seed(0))
    for objective in ("mlm", "span"):
        cfg = cfg_of(objective=objective, block_size=32, mask_rate=0.3)
        fam = weights.family(cfg)
        cfg.vocab_size = fam.vocabulary(cfg, TOK)
        n = fam.read_length(cfg)
        rows = ids[:, :n]
        x, y, kw = fam.corrupt(rows, cfg, TOK, 5, 16, torch.device("cpu"))
        assert kw == {"reduction": "sum"}
        for i in range(8):  # each row: the family's own function with its row's generator
            g = denoising.row_generator(cfg.seed, 5, 16 + i)
            want = (bert.mask_tokens(rows[i], mask_id=TOK.n_vocab, vocab_size=TOK.n_vocab, rate=0.3,
                                     special_ids=[TOK.eos_id], generator=g) if objective == "mlm" else
                    t5.span_corrupt(rows[i], vocab_size=cfg.vocab_size, eos_id=TOK.eos_id, generator=g))
            assert torch.equal(x[i], want[0]) and torch.equal(y[i], want[1]), (objective, i)
        halves = [fam.corrupt(rows[4 * r:4 * r + 4], cfg, TOK, 5, 16 + 4 * r, torch.device("cpu"))
                  for r in range(2)]  # two data ranks' shares
        assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
        other = fam.corrupt(rows, cfg, TOK, 6, 16, torch.device("cpu"))
        assert not torch.equal(other[1], y), f"{objective}: another step, the same masks"
        if objective == "mlm":
            assert cfg.vocab_size == TOK.n_vocab + 1 and (x == TOK.n_vocab).any()
            kept = y != IGNORE
            assert kept.any() and torch.equal(y[kept], rows[kept])  # the targets: the original ids, where chosen
        else:
            _, spans = t5.span_counts(n)
            assert n > 32 >= x.shape[1] and cfg.vocab_size == TOK.n_vocab + spans
            assert (x[:, :-1] >= TOK.n_vocab).sum(1).eq(spans).all()  # one sentinel per span, above the tokenizer
            assert x.max() == cfg.vocab_size - 1  # <extra_id_0>: the top id


def test_token_mean_is_the_global_batch_mean():
    torch.manual_seed(0)
    model = bert.Bert(bert.BertConfig(vocab_size=TOK.n_vocab + 1, block_size=32, n_layer=1, n_head=2, n_embd=16,
                                      dropout=0.0))
    cfg = cfg_of(objective="mlm", mask_rate=0.3)
    ids = torch.randint(0, TOK.n_vocab, (4, 32), generator=torch.Generator().manual_seed(1))
    x, y, _ = bert.FAMILY.corrupt(ids, cfg, TOK, 1, 0, torch.device("cpu"))
    y[:2, 8:] = IGNORE  # the first micro-batch predicts far fewer tokens than the second
    model(x, y).backward()  # reduction="mean": over all predicted tokens of the batch
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    net = parallel.parallelize(model, parallel.init(cfg_of()), cfg_of(), optimizer=False)
    micro = [(x[:2], y[:2], dict(reduction="sum")), (x[2:], y[2:], dict(reduction="sum"))]
    tally = net.train_step(micro, denoising.token_mean(micro, net.grid))
    net.wrapper.finish()
    assert_close({n: p.grad for n, p in model.named_parameters()}, want, "token_mean gradients")
    assert_close(tally, model(x, y).detach(), "token_mean tally")


# ----------------------------------------------------------------------------- pretrain.py end to end

def pretrain_run(args, nproc=1, check=True):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable]) + [os.path.join(ROOT, "pretrain.py")] + args
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"pretrain failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def metrics(out_dir, key):
    with open(os.path.join(out_dir, "train_metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def test_mlm_two_processes_equal_one(tmp_path, data_dir):
    common = SMALL + MLM + [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_every=0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    pretrain_run(common + [f"--out_dir={one}"])
    pretrain_run(common + [f"--out_dir={two}"], nproc=2)
    a, b = (load_file(os.path.join(d, "step_000006", "model.safetensors")) for d in (one, two))
    assert_close(b, a, "mlm: dp2 weights after 6 steps")
    la, lb = metrics(one, "loss"), metrics(two, "loss")
    assert_close(torch.tensor([lb[s] for s in range(1, 7)]), torch.tensor([la[s] for s in range(1, 7)]), "mlm losses")
    assert la[6] < la[1]
    assert sorted(metrics(one, "val_loss")) == [0, 3, 6] and not metrics(one, "val_bpb")  # no bits per byte


def test_span_exact_resume(tmp_path, data_dir):
    common = SMALL + SPAN + [f"--data_dir={data_dir}", "--max_steps=4", "--ckpt_every=2", "--eval_every=2"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    pretrain_run(common + [f"--out_dir={full}"])
    pretrain_run(common + [f"--out_dir={part}", "--stop_at=2"])
    pretrain_run(common + [f"--out_dir={part}", "--resume=True"])
    for key in ("loss", "val_loss"):
        a, b = metrics(full, key), metrics(part, key)
        assert a == b, f"{key}: uninterrupted {a} vs resumed {b}"
    assert a[4] < a[0]


# ----------------------------------------------------------------------------- init_from HF folders

def transformers_or_skip():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    return t


def test_init_from_hf_bert_and_t5(tmp_path):
    t = transformers_or_skip()
    V = TOK.n_vocab + 1
    torch.manual_seed(0)
    refs = {"bert": t.BertForMaskedLM(t.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=48,
                                                   max_position_embeddings=64)),
            "t5": t.T5ForConditionalGeneration(t.T5Config(vocab_size=V + 7, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                          num_heads=4, feed_forward_proj="gated-gelu",
                                                          tie_word_embeddings=True))}
    x = torch.randint(0, TOK.n_vocab, (2, 20), generator=torch.Generator().manual_seed(2))
    for name, ref in refs.items():
        folder = str(tmp_path / name)
        ref.eval().save_pretrained(folder)
        cfg = cfg_of(init_from=folder, tokenizer_vocab=512, block_size=32, given={"init_from", "tokenizer_vocab"})
        weights.configure(cfg)
        assert cfg.objective == {"bert": "mlm", "t5": "span"}[name] and cfg.tokenizer == "cl100k_base"
        grid = parallel.init(cfg)
        model = weights.build_model(cfg, grid)
        weights.loader(cfg, grid)(model)
        model.eval()
        with torch.no_grad():
            if name == "bert":
                got, want = model(x), ref(x).logits
            else:
                got, want = model(x, tgt=x[:, :7]), ref(input_ids=x, decoder_input_ids=x[:, :7]).logits
        assert (got - want).abs().max() <= 1e-4, name


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kw, match", [
    (dict(objective="mlm", activation="gelu", tp=2), "does not take tp > 1"),
    (dict(objective="span", activation="relu", lora_r=4), "does not take LoRA"),
    (dict(objective="mlm", activation="gelu", n_kv_head=2, given={"n_kv_head"}), "which has no n_kv_head"),
    (dict(objective="mlm", activation="swiglu"), "activation='swiglu'"),
    (dict(objective="span", activation="relu", fim_rate=0.5), "fim_rate"),
    (dict(objective="mlm", activation="gelu", vocab_size=512), r"no room for 1 \[MASK\]"),
    (dict(objective="bert"), "objective='bert' must be one of"),
])
def test_refusals(kw, match):
    with pytest.raises(config.ConfigError, match=match):
        pretrain.check(cfg_of(**{"tokenizer_vocab": 512, "vocab_size": TOK.n_vocab + 8, "block_size": 64, **kw}), TOK)


def test_decoder_checkpoint_under_mlm_refused(tmp_path, data_dir):
    out = str(tmp_path / "lm")
    pretrain_run(SMALL + [f"--data_dir={data_dir}", "--max_steps=1", "--eval_every=0", f"--out_dir={out}"])
    r = pretrain_run(SMALL + MLM + [f"--data_dir={data_dir}", f"--init_from={out}", f"--out_dir={tmp_path}/m"],
                     check=False)
    assert r.returncode == 2 and "set objective='lm'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_family_keys_belong_to_their_family(tmp_path, capsys):
    """A family's keys (denoising.py's DENOISING_DEFAULTS, prefix.py's PREFIX_DEFAULTS) join a run that chose it
    (objective, a variant's key given); given to a run that did not, one line names where they belong; --help
    still lists them with their comments."""
    import sft
    cfg = config.load(["--objective=mlm", "--activation=gelu", "--mask_rate=0.3"], extra=pretrain.EXTRA, world=1,
                      plugins=pretrain.FAMILY_KEYS)
    assert cfg.mask_rate == 0.3 and cfg.noise_density == 0.15
    assert not hasattr(config.load(["--seed=1"], extra=pretrain.EXTRA, world=1, plugins=pretrain.FAMILY_KEYS),
                       "mask_rate")
    with pytest.raises(config.ConfigError, match=r"^mask_rate is a key of BERT / T5 \(objective='mlm' or "
                                                 r"objective='span'\), which this run did not choose"):
        config.load(["--mask_rate=0.3"], extra=pretrain.EXTRA, world=1, plugins=pretrain.FAMILY_KEYS)
    assert config.load(["--prefix_tokens=4"], extra=sft.EXTRA, world=1, plugins=sft.FAMILY_KEYS).prefix_hidden == 0
    with pytest.raises(config.ConfigError, match=r"^prefix_hidden is a key of prefix tuning \(prefix_tokens > 0\)"):
        config.load(["--prefix_hidden=8"], extra=sft.EXTRA, world=1, plugins=sft.FAMILY_KEYS)
    with pytest.raises(SystemExit):
        config.load(["--help"], extra=pretrain.EXTRA, script=os.path.join(ROOT, "pretrain.py"),
                    plugins=pretrain.FAMILY_KEYS)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("mask_rate="))
    assert "share of positions predicted" in line


def test_sample_refuses_an_encoder(tmp_path):
    """sample.py on a BERT checkpoint: one line saying an encoder does not generate (the family's no_sample),
    before any weights are read."""
    import checkpoint
    import sample
    cfg = cfg_of(objective="mlm", activation="gelu", n_layer=1, n_head=2, n_embd=16, block_size=32,
                 tokenizer_vocab=512, vocab_size=TOK.n_vocab + 1)
    path = checkpoint.save(str(tmp_path / "bert"), 1, bert.Bert(weights.model_config(cfg)).state_dict(), None, cfg,
                           run_id="b")
    with pytest.raises(config.UserError, match="a BERT is an encoder: it does not generate text") as e:
        sample.main([path, "--device=cpu"])
    assert "\n" not in str(e.value)
