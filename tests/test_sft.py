"""sft.py, the supervised fine-tuning stage: against TRL, against one process, and its errors.

Proves:
- TRL parity (transformers + trl on a tiny random LLaMA saved locally with a local byte-level BPE and
  a ChatML template whose {% generation %} blocks hold each answer and its <|im_end|>; fp32): the
  tokens TRL's SFTTrainer (assistant_only_loss=True) trains are the ones chat.encode masks, and its
  per-batch loss (compute_loss on its own collated batch) equals sft.train_step's summed NLL / token
  count within 1e-5: padded like TRL's batch, packed, and split into two micro-steps holding
  different numbers of answer tokens (then also the same gradients as one micro-step: the mean
  over the global batch's tokens, not a mean of micro-batch means). No difference had to be removed.
- layouts: sft.main, full fine-tuning and LoRA, from one of our checkpoints (vocabulary grown by the
  chat tokens), under DP2, FSDP2, TP2 (one 2-process gloo spawn) and TP2 x DP2 (one 4-process spawn)
  gives the one-process weights and adapters after 3 steps (relative error <= 1e-5) and the same
  held-out accuracy (greedy answers, items split over data ranks); the one-process run's step 2
  resumes in a new run folder under FSDP2 (full) / TP2 (LoRA) to its step 3.
- LoRA outputs: the checkpoint folder holds the adapter in PEFT's format (its tensors under PEFT's
  names; the chat tokens' trained embedding / head rows with their ids); merge= writes a checkpoint whose logits equal the LoRA model's (adapters on the fly,
  restored by checkpoint.load), the same from a TP2 run; export_hf= writes a folder transformers
  loads with the same logits; a LoRA checkpoint as init_from starts from the merged weights;
  sample.py --chat answers with the eager generate()'s greedy tokens.
- init_from: a run folder configures the model shape and tokenizer (weights.configure) and names its
  newest checkpoint; new vocabulary rows are the mean of the old ones (ours and HF's).
- bad input stops sft.main with one UserError before anything is written: a missing init_from, LoRA
  targets the model lacks, a malformed record (file and line named), merge without LoRA, data that
  cannot fill one batch, no data at all.
"""
import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import chat
import checkpoint
import config
import generate
import hf
import lora
import parallel
import sample
import sft
import weights
from distributed import assert_close, load_checkpoint, spawn
from model import IGNORE, ModelConfig, Transformer

TINY = dict(tokenizer="cl100k_base", tokenizer_vocab=512, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2,
            n_embd=32, block_size=64)
STEPS = 3
COMMON = ["--n_train=64", "--n_eval=4", "--eval_tokens=2", "--eval_batch=2", "--batch_size=4", "--micro_batch_size=1",
          f"--max_steps={STEPS}", "--lr=3e-3", "--warmup_steps=0", "--schedule=constant", "--eps=1e-6",
          "--log_every=1", "--progress=False", "--device=cpu", "--ckpt_every=2"]
LORA = ["--lora_r=4", "--lora_alpha=8", "--lr=1e-2"]
LAYOUTS = {"dp2": ["--tp=1"], "fsdp2": ["--data_parallel=fsdp"], "tp2": ["--tp=2"], "tp2_dp2": ["--tp=2"]}


def run_cfg(**kw):
    """A flat SFT config as sft.main builds it (defaults + chat + SFT keys), on CPU."""
    return SimpleNamespace(**{**config.defaults(sft.EXTRA), "device": "cpu", **kw})


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """One of our checkpoints (a tiny random LLaMA-style model, cl100k truncated to 512 ids) in a run folder."""
    root = tmp_path_factory.mktemp("sft")
    cfg = run_cfg(**TINY)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    checkpoint.save(str(root / "init"), 7, model.state_dict(), None, cfg, run_id="init")
    return root


def args(root, name, *extra):
    return [f"--init_from={root}/init", f"--out_dir={root}/{name}", *COMMON, *extra]


def saved_weights(root, name, step=STEPS):
    return load_file(str(root / name / f"step_{step:06d}" / "model.safetensors"))


def accuracies(root, name):
    with open(root / name / "train_metrics.jsonl") as f:
        return [r["accuracy"] for r in map(json.loads, f) if "accuracy" in r]


def _runs(rank, runs):
    for argv in runs:
        sft.main(argv)


@pytest.fixture(scope="module")
def reference(init):
    """One process: full fine-tuning, and LoRA with merge= and export_hf=."""
    sft.main(args(init, "ref_full"))
    sft.main(args(init, "ref_lora", *LORA, f"--merge={init}/merged", f"--export_hf={init}/hf_export"))
    return init


def check_same(root, name, ref):
    got, want = saved_weights(root, name), saved_weights(root, ref)
    assert_close(got, want, f"{name} vs {ref}")
    assert accuracies(root, name) == accuracies(root, ref), name


def test_accuracy_before_and_after(reference):
    """The task's held-out accuracy is scored before the first step and after the last (eval_every=0)."""
    assert len(accuracies(reference, "ref_full")) == 2 and len(accuracies(reference, "ref_lora")) == 2


def test_layouts_and_resume_equal_one_process(reference):
    root = reference
    two = [args(root, f"{name}_{kind}", *LAYOUTS[name], *extra) for name in ("dp2", "fsdp2")
           for kind, extra in (("full", []), ("lora", LORA))]
    two += [args(root, "tp2_full", "--tp=2"), args(root, "tp2_lora", "--tp=2", *LORA, f"--merge={root}/merged_tp2")]
    # the one-process run's step 2 resumed under another layout, in a new run folder
    two += [args(root, "resume_full", f"--resume={root}/ref_full/step_000002", "--data_parallel=fsdp"),
            args(root, "resume_lora", f"--resume={root}/ref_lora/step_000002", *LORA, "--tp=2")]
    spawn(_runs, 2, two)
    spawn(_runs, 4, [args(root, f"tp2_dp2_{kind}", "--tp=2", *extra) for kind, extra in (("full", []), ("lora", LORA))])
    for kind in ("full", "lora"):
        for name in ("dp2", "fsdp2", "tp2", "tp2_dp2"):
            check_same(root, f"{name}_{kind}", f"ref_{kind}")
        assert_close(saved_weights(root, f"resume_{kind}"), saved_weights(root, f"ref_{kind}"), f"resume_{kind}")
    assert_close(saved_weights(root, "merged_tp2"), saved_weights(root, "merged"), "merge= under TP2")
    full, ref = saved_weights(root, "ref_lora"), saved_weights(root, "ref_full")
    init = checkpoint.read_weights(str(root / "init" / "step_000007"),
                                   **weights.reference(ModelConfig.from_cfg(run_cfg(**TINY))))
    assert torch.equal(full["blocks.0.attn.qkv.weight"], init["blocks.0.attn.qkv.weight"])  # LoRA: base frozen
    assert not torch.equal(ref["blocks.0.attn.qkv.weight"], init["blocks.0.attn.qkv.weight"])


def test_lora_outputs(reference, capsys):
    root = reference
    ckpt = root / "ref_lora" / f"step_{STEPS:06d}"
    saved = load_file(str(ckpt / "model.safetensors"))
    cfg = run_cfg(**json.loads((ckpt / "config.json").read_text()))
    peft = load_file(str(ckpt / "adapter_model.safetensors"))
    mcfg = ModelConfig.from_cfg(cfg)
    # (the trainable token rows' ids live in adapter_config.json, not among PEFT's tensors)
    adapters = {k: v for k, v in saved.items() if lora.is_adapter(k) and not k.endswith(".lora_tokens.ids")}
    assert adapters and {lora.peft_name(k, mcfg): v for k, v in adapters.items()}.keys() == peft.keys()
    assert all(torch.equal(peft[lora.peft_name(k, mcfg)], v) for k, v in adapters.items())
    adapter_config = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4
    new = list(range(TINY["vocab_size"], cfg.vocab_size))  # the chat template's tokens, just added
    assert new == [512, 513] and adapter_config["trainable_token_indices"] == {"embed_tokens": new, "lm_head": new}
    init = checkpoint.read_weights(str(root / "init" / "step_000007"),
                                   **weights.reference(ModelConfig.from_cfg(run_cfg(**TINY))))
    merged_weights = saved_weights(root, "merged")
    for m in ("tok_emb", "head"):  # the new rows trained (they started equal: the mean of the old rows)
        rows, start = saved[f"{m}.lora_tokens.rows"], init[f"{m}.weight"][:512].mean(0)
        assert saved[f"{m}.lora_tokens.ids"].tolist() == new
        assert (rows[0] - rows[1]).abs().max() > 1e-3 and ((rows - start).abs().max(-1).values > 1e-3).all(), m
        assert torch.equal(merged_weights[f"{m}.weight"][new], rows)  # merge= folds them in
        assert torch.equal(merged_weights[f"{m}.weight"][:512], init[f"{m}.weight"][:512])  # the old rows: frozen

    grid = parallel.init(cfg)  # one process
    model = lora.apply(Transformer(mcfg), cfg, grid)  # adapters on the fly, restored with the base
    lora.train_tokens(model, new, grid)  # and the new tokens' rows
    load_checkpoint(str(ckpt), model, None, grid)
    merged, _, merged_cfg = sample.load(str(root / "merged"))
    x = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(x)
        assert_close(merged(x), want, "merged", tol=1e-5)
        transformers = pytest.importorskip("transformers")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf_export")).eval()
        assert_close(theirs(x).logits, want, "export_hf", tol=1e-5)

    start = run_cfg(init_from=str(root / "ref_lora"), vocab_size=cfg.vocab_size)  # a LoRA run as init_from
    weights.configure(start)
    fresh = Transformer(ModelConfig.from_cfg(start))
    weights.loader(start, grid)(fresh)
    assert_close(fresh.state_dict(), merged.state_dict(), "init_from a LoRA run")

    tok, template = sample.chat_setup(str(root / "merged"), merged_cfg)
    ids = chat.encode(tok, template, [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)[0]
    out = generate.generate(merged, torch.tensor([ids]), 4, vocab=tok, temperature=0.0, stop_tokens=[tok.eot_id])[0, len(ids):]
    capsys.readouterr()
    sample.main([str(root / "merged"), "--chat", "--prompt=What is 2 + 3?", "--tokens=4", "--temperature=0",
                 "--device=cpu"])
    answer = tok.decode([t for t in out.tolist() if t != tok.eot_id])
    assert capsys.readouterr().out == f"--- answer 0 ---\n{answer}\n"


def test_init_from_run_folder_grows_vocabulary(init):
    cfg = run_cfg(init_from=str(init / "init"), n_layer=7, tokenizer="gpt2")
    assert weights.configure(cfg) == f"model and tokenizer of checkpoint {init}/init/step_000007"
    assert (cfg.init_from, cfg.n_layer, cfg.n_embd, cfg.tokenizer, cfg.tokenizer_vocab) == \
        (str(init / "init" / "step_000007"), 2, 32, "cl100k_base", 512)
    tok, _ = chat.setup(cfg)
    assert cfg.vocab_size == tok.n_vocab == 514  # <|im_start|>, <|im_end|> added past the 512 ids
    model = Transformer(ModelConfig.from_cfg(cfg))
    weights.loader(cfg, parallel.init(cfg))(model)
    old = checkpoint.read_weights(cfg.init_from, **weights.reference(ModelConfig.from_cfg(run_cfg(**TINY))))
    for k in ("tok_emb.weight", "head.weight"):
        new = model.state_dict()[k]
        assert torch.equal(new[:512], old[k][:512])
        assert_close(new[512:514], old[k][:512].mean(0).expand(2, -1), k, tol=1e-6)
        assert not new[514:].any()  # padding rows


# ----------------------------------------------------------------------------- against TRL

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
            "{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 30 - 4?"},
     {"role": "assistant", "content": "It is 26."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, how are you?"},
     {"role": "user", "content": "Write add(a, b)."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "user", "content": "And 3 + 4?"}, {"role": "assistant", "content": "7"}],
]


@pytest.fixture(scope="module")
def hf_chat(tmp_path_factory):
    """A tiny random LlamaForCausalLM with a local byte-level BPE and TEMPLATE, saved as an HF folder."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = str(tmp_path_factory.mktemp("hf_chat"))
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["user assistant system the answer is"] * 20
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=320, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, tok


def test_loss_equals_trl(hf_chat, tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    folder, hf_tok = hf_chat
    trainer = trl.SFTTrainer(
        model=folder, processing_class=hf_tok, train_dataset=datasets.Dataset.from_dict({"messages": CONVERSATIONS}),
        args=trl.SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, bf16=False, use_cpu=True,
                           report_to="none", activation_checkpointing=False, max_length=None))
    rows = [trainer.train_dataset[i] for i in range(len(CONVERSATIONS))]
    trainer.model.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows)).item()

    cfg = run_cfg(init_from=folder)
    weights.configure(cfg)
    tok, template = chat.setup(cfg)
    examples = [chat.encode(tok, template, c) for c in CONVERSATIONS]
    for (ids, mask), row in zip(examples, rows):  # the same ids, the same trained tokens
        assert ids == row["input_ids"]
        assert mask == [t != IGNORE for t in row["labels"]]
    grid = parallel.init(cfg)
    run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg, load=weights.loader(cfg, grid))
    T = max(len(ids) for ids, _ in examples) - 1
    padded = chat.pack(examples, T, one_per_row=True)[0]
    packed = chat.pack(examples, 2 * T)[0]
    grads = []
    for micro in ([padded], [packed], [padded[:1], padded[1:]]):
        nll, count = sft.train_step(run, [weights.DECODER.sft_batch(r) for r in micro], contextlib.nullcontext())
        assert abs(nll.item() / count.item() - trl_loss) <= 1e-5 * trl_loss, (micro, nll / count, trl_loss)
        run.wrapper.finish()
        grads.append({n: p.grad.clone() for n, p in run.raw.named_parameters()})
        run.wrapper.zero_grad()
    assert len(packed) < len(padded)
    assert_close(grads[1], grads[0], "packed gradients")
    assert_close(grads[2], grads[0], "two micro-steps' gradients")


def test_held_out_loss_runs_training_shaped_batches(init):
    """held_out_loss feeds the net micro_batch_size rows each time (5 rows, micro-batches of 2: the last
    filled with row 0, its targets IGNORE) and returns the mean NLL over the real rows' trained tokens,
    worked out here from the model's logits and torch's cross_entropy on all 5 rows at once."""
    cfg = run_cfg(**TINY, micro_batch_size=2, objective="lm")  # (sft.main sets objective from init_from)
    tok, template = chat.setup(cfg)
    convs = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]
             for i in range(5)]
    rows = chat.pack([chat.encode(tok, template, c) for c in convs], 24, one_per_row=True)[0]
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
    shapes = []
    net.raw.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
    got = sft.held_out_loss(net, rows, cfg, contextlib.nullcontext())
    assert shapes == [(2, 24)] * 3
    x, y, pos, mask = chat.batch(rows)
    with torch.no_grad():
        logits = net.raw(x, pos=pos, attn_mask=mask)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
    assert abs(got - want.item()) <= 1e-5 * want.item(), (got, want.item())


def test_hf_vocabulary_grows(hf_chat):
    folder, hf_tok = hf_chat
    cfg = run_cfg(init_from=folder)
    weights.configure(cfg)
    n = cfg.vocab_size
    cfg.vocab_size = n + 3  # as if the template had brought three new tokens
    model = Transformer(ModelConfig.from_cfg(cfg))
    weights.loader(cfg, parallel.init(cfg))(model)
    ref = hf.load_hf(folder)
    for k in ("tok_emb.weight", "head.weight"):
        got, old = model.state_dict()[k], ref.state_dict()[k][:n]
        assert torch.equal(got[:n], old)
        assert_close(got[n:n + 3], old.mean(0).expand(3, -1), k, tol=1e-6)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("extra, error, match", [
    (["--init_from=/no/such/model"], config.MissingFileError, "init_from=/no/such/model: no such folder"),
    (["--lora_r=4", "--lora_targets=c_attn"], config.ConfigError, "unknown module names"),
    (["--chat_data={bad}", "--task="], chat.ChatDataError, r"bad\.jsonl:2"),
    (["--merge={root}/m"], config.ConfigError, "needs lora_r > 0"),
    (["--batch_size=4096", "--micro_batch_size=2"], config.ConfigError, "cannot fill one global batch"),
    (["--task="], config.ConfigError, "no training data"),
])
def test_bad_input_stops_before_work(init, tmp_path, extra, error, match):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "no answer"}]}) + "\n")
    out = tmp_path / "out"
    argv = args(init, "unused", *[e.format(bad=bad, root=tmp_path) for e in extra]) + [f"--out_dir={out}"]
    with pytest.raises(error, match=match):
        sft.main(argv)
    assert not out.exists()  # found before the run folder was even claimed
