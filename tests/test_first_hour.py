"""A new user's first hour (issue 32): eval on chat checkpoints, HF export of a chat model, results
files, and bad input that must read as one clear line. Offline, CPU, tiny models.

Proves:
- eval.py on a chat-tuned checkpoint (a ChatML tokenizer: ids past the base vocabulary) generates
  and decodes those ids: a model rigged to answer '<|im_start|>' then '7' then '<|im_end|>' gives
  exactly the text '<|im_start|>7' (the end-of-turn id stops the decoder and is not printed), and
  the CLI's gsm8k on that checkpoint equals gsm8k_scores of those completions;
- that model exported (hf.export_hf with its chat tokenizer) has generation_config eos_token_id
  [end of turn, EOS], and transformers' greedy generate stops right after <|im_end|>;
- eval.py never overwrites results: a second run with the default name writes <model>_2.json and
  leaves the first file as it was; --results naming an existing file is refused before evaluating;
- bad input reads as one line (config.cli: exit status 2, `error: ...`, no traceback) naming the
  file and what to change: an HF folder without config.json / model.safetensors / tokenizer files,
  with a truncated model.safetensors or a malformed config.json (sample.py, eval.py and its
  init_from path, hf.load_hf); invalid UTF-8 in a jsonl of records (chat data, task files) names
  file:line, or is skipped and counted (skip_bad); a pretraining corpus still reads it with U+FFFD
  and names the file in its intake summary; eval's piqa label 7, an empty task file, --limit=-5;
  sample.py on a checkpoint whose weights do not fit its config (CheckpointError, no traceback);
  a loss that is not finite (--lr=1e6) is one line; init_from names the given keys it replaced;
- discovery: eval.py --help lists its keys (hf.py, fim.py print their docstring); threads per process
  as parallel.init picks them; pretraining says how many validation tokens its loss covers and, as
  SFT on the user's own data (a held-out slice, its loss, the epochs warning), ends with one summary
  line whose before -> after values are the logged ones and which names the final checkpoint.
"""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import chat
import checkpoint
import config
import eval as ev
import hf
import lifecycle
from corpora import corpus
from model import ModelConfig, Transformer
from tools import evaltasks, scoring

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = ["--tokenizer_vocab=512", "--vocab_size=512", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=32", "--device=cpu"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def rigged_chat_checkpoint(out_dir, direct=False):
    """An SFT-like checkpoint (chat keys in its config, vocabulary 512 + the two ChatML tokens) whose
    model is a bigram table: blocks add nothing, so the logits depend on the last token only. After
    any other token it says <|im_start|> (direct: '7' at once), after that '7', after '7' <|im_end|>
    (and then it starts over). -> (tok, seven, model)."""
    import sft
    cfg = config.load(SHAPE, extra=sft.EXTRA)
    tok, _ = chat.setup(cfg)
    start, end, seven = tok.special_tokens["<|im_start|>"], tok.eot_id, tok.encode("7")[0]
    assert (start, end, cfg.vocab_size) == (512, 513, 514)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
            block.mlp.proj.weight.zero_()
        emb, head = model.tok_emb.weight, model.head.weight
        emb.zero_()
        emb[:, 0] = 1.0                          # any other token: direction 0
        emb[start] = 0.0
        emb[start, 1] = 1.0                      # <|im_start|>: direction 1
        emb[seven] = 0.0
        emb[seven, 2] = 1.0                      # '7': direction 2
        head.zero_()
        head[seven if direct else start, 0] = head[seven, 1] = head[end, 2] = 10.0
    checkpoint.save(str(out_dir), 1, model.state_dict(), None, cfg)
    return tok, seven, model


def test_eval_decodes_chat_tokens(tmp_path):
    tok, seven, _ = rigged_chat_checkpoint(tmp_path / "sft")
    gsm = tmp_path / "gsm.jsonl"
    write_jsonl(gsm, [{"question": f"What is {a} + 4?", "answer": f"#### {a + 4}"} for a in (3, 5)])
    out = tmp_path / "res.json"
    res = ev.main([str(tmp_path / "sft"), f"--tasks=gsm8k={gsm}", "--num_fewshot=0", "--max_new_tokens=6",
                   f"--results={out}", "--device=cpu"])
    cfg = ev.load_config([str(tmp_path / "sft"), "--device=cpu"])
    tok = ev.model_tokenizer(cfg)
    assert tok.eot_id == 513 and tok.decode([512, seven]) == "<|im_start|>7"
    run = ev.load_model(cfg, ev.parallel.init(cfg))
    texts = scoring.generate_texts(run, tok, ["Question: What is 3 + 4?\nAnswer:"] * 2, 6)
    assert texts == [["<|im_start|>7"]] * 2
    docs, contexts = evaltasks.task_prompts("gsm8k", str(gsm), SimpleCfg())
    texts = scoring.generate_texts(run, tok, contexts, 6, stops=ev.GSM8K_STOPS)
    assert [t[0] for t in texts] == ["<|im_start|>7"] * 2
    assert res["gsm8k"] == scoring.gsm8k_scores([t[0] for t in texts], docs)[0]
    assert res["gsm8k"]["exact_match_flexible"] == 0.5  # '7' is 3 + 4, not 5 + 4


def test_exported_chat_model_stops_at_end_of_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok, seven, model = rigged_chat_checkpoint(tmp_path / "sft")
    hf.export_hf(model, str(tmp_path / "hf"), tokenizer=tok)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eot_id, tok.eos_id] == [513, 511]  # [end of turn, EOS], as Qwen2's
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = torch.tensor([tok.encode("What is 3 + 4?")])
    out = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_id)
    assert out[0, prompt.shape[1]:].tolist() == [512, seven, 513]  # stopped at <|im_end|>


class SimpleCfg:
    limit, num_fewshot, fewshot_seed = 0, 0, 1234


def test_eval_never_overwrites_results(tmp_path, monkeypatch):
    rigged_chat_checkpoint(tmp_path / "sft")
    gsm = tmp_path / "gsm.jsonl"
    write_jsonl(gsm, [{"question": "What is 3 + 4?", "answer": "#### 7"}])
    monkeypatch.chdir(tmp_path)  # the default results folder is ./out/eval
    args = [str(tmp_path / "sft"), f"--tasks=gsm8k={gsm}", "--num_fewshot=0", "--max_new_tokens=4", "--device=cpu"]
    ev.main(args)
    first = sorted((tmp_path / "out" / "eval").iterdir())
    assert len(first) == 1 and first[0].name.endswith("_sft_step_000001.json")
    before = first[0].read_text()
    ev.main(args + ["--limit=1", "--temperature=0.5"])
    second = sorted((tmp_path / "out" / "eval").iterdir())
    assert [p.name for p in second] == [first[0].name, first[0].name[:-5] + "_2.json"]
    assert first[0].read_text() == before
    assert json.loads(second[1].read_text())["settings"]["temperature"] == 0.5
    with pytest.raises(scoring.EvalError, match=r"--results=.*_step_000001.json exists: eval.py never overwrites"):
        ev.main(args + [f"--results={first[0]}"])
    assert first[0].read_text() == before


# ----------------------------------------------------------------------------- bad input: one line each

def one_error_line(main, argv, capsys):
    """Run main under config.cli as the scripts do -> the one stderr line (exit status 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        config.cli(main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def break_folder(folder, how):
    if how == "no_config":
        os.remove(folder / "config.json")
    elif how == "no_weights":
        os.remove(folder / "model.safetensors")
    elif how == "no_tokenizer":
        os.remove(folder / "tokenizer.json")
    elif how == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    else:
        (folder / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 32,,\n}')


BROKEN = {"no_config": r"config.json not found", "no_weights": r"no model.safetensors",
          "no_tokenizer": r"no tokenizer files", "truncated": r"model.safetensors: cannot read it .*incomplete",
          "bad_config": r"config.json:2: not valid JSON"}


@pytest.mark.parametrize("how", list(BROKEN))
def test_broken_hf_folder(tmp_path, how, capsys):
    import sample
    tok, _, model = rigged_chat_checkpoint(tmp_path / "sft")
    folder = tmp_path / "hf"
    hf.export_hf(model, str(folder), tokenizer=tok)
    break_folder(folder, how)
    gsm = tmp_path / "gsm.jsonl"
    write_jsonl(gsm, [{"question": "What is 3 + 4?", "answer": "#### 7"}])
    for main, argv in [(sample.main, [str(folder), "--tokens=2", "--device=cpu"]),
                       (ev.main, [str(folder), f"--tasks=gsm8k={gsm}", "--max_new_tokens=2", "--device=cpu",
                                  f"--results={tmp_path / 'r.json'}"])]:
        line = one_error_line(main, argv, capsys)
        assert str(folder) in line and re.search(BROKEN[how], line), line
    if how != "no_tokenizer":
        with pytest.raises(config.UserError, match=BROKEN[how]):
            hf.load_hf(str(folder))


def test_invalid_utf8_in_jsonl(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = tmp_path / "chat.jsonl"
    path.write_bytes((good + "\n").encode() + b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n'
                     + (good + "\n").encode())
    with pytest.raises(corpus.DataError, match=re.escape(f"{path}:2: not valid UTF-8 (byte 0xff at byte 44")):
        chat.read_conversations(str(path))
    convs, skipped = chat.read_conversations(str(path), skip_bad=True)
    assert len(convs) == 2 and skipped == {"not_utf8": 1}
    piqa = tmp_path / "piqa.jsonl"
    piqa.write_bytes(b'{"goal": "g\xc3", "sol1": "a", "sol2": "b", "label": 0}\n')
    with pytest.raises(corpus.DataError, match=re.escape(f"{piqa}:1: not valid UTF-8")):
        evaltasks.task_prompts("piqa", str(piqa), SimpleCfg())
    corpus_file = tmp_path / "docs.jsonl"  # a pretraining corpus: read with U+FFFD, the file named in the summary
    corpus_file.write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    intake = corpus.Intake()
    assert list(corpus.iter_documents(str(corpus_file), report=intake)) == ["caf\ufffd au lait"]
    assert intake.replaced == [str(corpus_file)] and "U+FFFD" in intake.summary()[0]


def test_eval_bad_task_input(tmp_path, capsys):
    piqa = tmp_path / "piqa.jsonl"
    write_jsonl(piqa, [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}, {"goal": "g", "sol1": "a", "sol2": "b",
                                                                          "label": 7}])
    with pytest.raises(scoring.EvalError, match=r"piqa.jsonl record 2: its answer is choice 7, but it has 2 choices"):
        evaltasks.task_prompts("piqa", str(piqa), SimpleCfg())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(scoring.EvalError, match=r"task piqa: .*empty.jsonl holds no records"):
        evaltasks.task_prompts("piqa", str(empty), SimpleCfg())
    rigged_chat_checkpoint(tmp_path / "sft")
    run = [str(tmp_path / "sft"), "--device=cpu", f"--results={tmp_path / 'r.json'}"]
    assert "limit=-5 must be >= 0" in one_error_line(ev.main, run + [f"--tasks=piqa={piqa}", "--limit=-5"], capsys)
    assert "holds no records" in one_error_line(ev.main, run + [f"--tasks=piqa={empty}"], capsys)
    assert not (tmp_path / "r.json").exists()


def test_sample_checkpoint_of_another_shape(tmp_path):
    import sample
    rigged_chat_checkpoint(tmp_path / "sft")
    ckpt = tmp_path / "sft" / "step_000001"
    cfg = json.loads((ckpt / "config.json").read_text())
    text = (ckpt / "config.json").read_text().replace('"n_embd": 32', '"n_embd": 64')  # same size: sizes still check
    assert cfg["n_embd"] == 32 and len(text) == len((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(text)
    r = subprocess.run([sys.executable, sample.__file__, str(tmp_path / "sft"), "--tokens=2", "--device=cpu"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))  # as a user runs it
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: checkpoint '{ckpt}' does not fit this model config:"), r.stderr


# ----------------------------------------------------------------------------- discovery and the stages' summaries

def test_help_of_eval_hf_fim(capsys):
    """eval.py --help lists its keys with default and comment (no model needed); hf.py and fim.py,
    libraries, print their docstring when run (they printed nothing)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ev.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "eval.py's own keys" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("n_samples="))
    assert line.split() == ["n_samples=1", *"generations per problem (pass@k needs k <= n_samples)".split()]
    with pytest.raises(scoring.EvalError, match=r"name the model: .*\(--help lists the keys\)"):
        ev.main(["--tasks=bpb"])
    from corpora import fim
    for module in (hf, fim):  # as a user runs them from the root: python hf.py, python -m corpora.fim
        r = subprocess.run([sys.executable, "-m", module.__name__, "--help"], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0 and r.stdout == module.__doc__ + "\n", r.stderr


def test_init_from_names_the_keys_it_replaced(tmp_path):
    """`sft.py --init_from=<ckpt> --n_layer=8` used to drop n_layer without a word: the start-up line
    (weights.configure's) now names each given model or tokenizer key init_from replaced; block_size
    (capped, not replaced) and keys equal to the checkpoint's are not named."""
    import sft
    import weights
    rigged_chat_checkpoint(tmp_path / "sft")
    init = f"--init_from={tmp_path / 'sft'}"
    cfg = config.load([init, "--n_layer=8", "--n_head=2", "--block_size=32", "--tokenizer_vocab=600"], extra=sft.EXTRA)
    line = weights.configure(cfg)
    assert (cfg.n_layer, cfg.block_size, cfg.tokenizer_vocab) == (1, 32, 512)
    assert line.endswith("; note: init_from's n_layer=1 (not 8 as given), tokenizer_vocab=512 (not 600 as given): "
                         "drop those keys, or start without init_from"), line
    cfg = config.load([init, "--block_size=32"], extra=sft.EXTRA)
    assert "note" not in weights.configure(cfg)


def test_nan_loss_is_one_line(tmp_path, capsys):
    """--lr=1e6 used to end in a FloatingPointError traceback: a loss that is not finite is a UserError
    (logs.NonFiniteLoss), one `error:` line under config.cli saying what to try."""
    import logs
    cfg = config.load([f"--out_dir={tmp_path}"], extra=lifecycle.TRAIN, world=1)

    def stage(argv):
        logs.Logger(cfg, SimpleNamespace(is_main=True)).report(5, {"loss": float("nan")}, 10, write=lambda s: None)
    line = one_error_line(stage, [], capsys)
    assert line == "error: loss is nan at step 5: lower lr (or warm up longer), or check the data"


def test_threads_per_process(monkeypatch):
    """parallel.init's threads: the given number; 0 without OMP_NUM_THREADS: the available cores divided
    among this machine's processes; 0 with OMP_NUM_THREADS (torchrun sets 1): left as it is."""
    import parallel
    cfg = config.load(["--device=cpu"], extra=lifecycle.TRAIN, world=1)
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        parallel.init(cfg, 3)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        parallel.init(cfg, 0)
        assert torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        parallel.init(cfg, 0)
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(before)


def summary_line(out):
    lines = [ln for ln in out.splitlines() if " done: " in ln]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_pretrain_says_its_validation_tokens_and_ends_with_a_summary(tmp_path, capsys):
    """Pretraining on CPU says its threads, how many validation tokens its loss covers (of how many:
    eval.py scores all), and ends with one line: steps, the held-out loss before -> after as logged,
    the final checkpoint's folder."""
    import pretrain
    out = tmp_path / "run"
    capsys.readouterr()
    pretrain.main(["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=1", "--n_head=2", "--n_embd=32",
                   "--block_size=32", "--batch_size=2", "--micro_batch_size=2", "--max_steps=2", "--eval_every=2",
                   "--eval_batches=2", "--sample_tokens=0", "--progress=False", "--device=cpu", "--threads=1",
                   f"--out_dir={out}", f"--data_dir={tmp_path / 'data'}"])
    text = capsys.readouterr().out
    assert "on cpu (1 threads per process)" in text
    meta = json.loads(next((tmp_path / "data").rglob("meta.json")).read_text())
    covered = re.findall(rf"\(the first ([\d,]+) of {meta['n_val']:,} validation tokens; eval.py scores them all\)", text)
    assert covered and int(covered[0].replace(",", "")) == 2 * 2 * 32  # eval_batches x batch x block
    vals = [(r["step"], r["val_loss"]) for r in map(json.loads, open(out / "train_metrics.jsonl")) if "val_loss" in r]
    (s0, v0), (s1, v1) = vals[0], vals[-1]
    line = summary_line(text)
    assert line.startswith("pretraining done: 2 steps in ")
    assert f"held-out validation loss {v0:.4f} (step {s0}) -> {v1:.4f} (step {s1})" in line and (s0, s1) == (0, 2)
    assert line.endswith(f"final checkpoint {out / 'step_000002'}") and (out / "step_000002" / "complete.json").exists()


def test_summary_after_a_resume_keeps_the_runs_first_value(tmp_path, capsys):
    """Stopped at step 2 and resumed to 4, the closing line's "before" is the run's first held-out loss
    (step 0, kept in the checkpoint), not the resumed step's."""
    import pretrain
    out, args = tmp_path / "run", ["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=1", "--n_head=2", "--n_embd=32",
                                   "--block_size=32", "--batch_size=2", "--micro_batch_size=2", "--max_steps=4",
                                   "--eval_every=2", "--eval_batches=2", "--sample_tokens=0", "--progress=False",
                                   "--device=cpu", "--threads=1", "--ckpt_every=2", f"--data_dir={tmp_path / 'data'}"]
    pretrain.main(args + [f"--out_dir={out}", "--stop_at=2"])
    capsys.readouterr()
    pretrain.main(args + [f"--out_dir={out}", "--resume"])
    line = summary_line(capsys.readouterr().out)
    vals = [(r["step"], r["val_loss"]) for r in map(json.loads, open(out / "train_metrics.jsonl")) if "val_loss" in r]
    (s0, v0), (s1, v1) = vals[0], vals[-1]
    assert (s0, s1) == (0, 4) and f"held-out validation loss {v0:.4f} (step 0) -> {v1:.4f} (step 4)" in line, line


def test_sft_on_own_data_reports_held_out_accuracy(tmp_path, capsys):
    """SFT on the user's GSM8K-style chat_data (no task): the held-out conversations whose answers can be
    checked (`#### N`, or the record's `answer` field, which wins) are answered greedily before and after,
    and their accuracy is reported and summarised. The rigged model always answers 7: of the two held-out
    problems (golds 7 from the answer field, 19) it gets one, 50%, worked by hand."""
    import sft
    rigged_chat_checkpoint(tmp_path / "init", direct=True)
    data = tmp_path / "gsm.jsonl"
    write_jsonl(data, [{"prompt": f"Tom has {i} apples. How many?", "completion": f"He has {i}.\n#### {i}",
                        **({"answer": "7"} if i == 9 else {})} for i in range(20)])
    out = tmp_path / "sft"
    capsys.readouterr()
    sft.main([f"--init_from={tmp_path / 'init'}", f"--chat_data={data}", "--task=", "--held_out=0.1", "--pack=False",
              "--batch_size=4", "--micro_batch_size=4", "--max_steps=1", "--lr=1e-9", "--warmup_steps=0",
              "--progress=False", "--device=cpu", "--threads=1", f"--out_dir={out}"])
    text = capsys.readouterr().out
    assert "step 0 | held-out validation loss" in text and "| accuracy 50.0% of 2 own answers items" in text, text
    acc = [(r["step"], r["accuracy"]) for r in map(json.loads, open(out / "train_metrics.jsonl")) if "accuracy" in r]
    assert acc == [(0, 0.5), (1, 0.5)]
    assert "held-out accuracy 50.0% (step 0) -> 50.0% (step 1)" in summary_line(text)


def test_sft_on_own_data_holds_out_a_slice(tmp_path, capsys):
    """SFT on the user's chat_data (no task) holds out every 1/held_out-th conversation, says so, reports
    its loss before and after in the summary line, and warns when the steps read past ~10 epochs."""
    import sft
    rigged_chat_checkpoint(tmp_path / "init")
    data = tmp_path / "mine.jsonl"
    write_jsonl(data, [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                     {"role": "assistant", "content": str(i + 1)}]} for i in range(20)])
    out = tmp_path / "sft"
    capsys.readouterr()
    sft.main([f"--init_from={tmp_path / 'init'}", f"--chat_data={data}", "--task=", "--held_out=0.1", "--pack=False",
              "--batch_size=4", "--micro_batch_size=4", "--max_steps=50", "--lr=1e-3", "--warmup_steps=0",
              "--log_every=25", "--progress=False", "--device=cpu", "--threads=1", f"--out_dir={out}"])
    text = capsys.readouterr().out
    assert "| 50 steps read 11.11 epochs (warning: past ~10 epochs a model memorises its data" in text  # 50 x 4 / 18
    assert "data: 18 conversations -> 18 rows" in text  # 20 less the 10th and the 20th, held out
    assert "| 1 held-out rows (every 10th conversation)" in text  # the two packed into one row
    vals = [(r["step"], r["val_loss"]) for r in map(json.loads, open(out / "train_metrics.jsonl")) if "val_loss" in r]
    (s0, v0), (s1, v1) = vals[0], vals[-1]
    assert (s0, s1) == (0, 50) and v1 < v0
    line = summary_line(text)
    assert line.startswith("SFT done: 50 steps in ") and f"(step 0) -> {v1:.4f} (step 50)" in line, line
    assert f"{v0:.4f} (step 0)" in line and line.endswith(f"final checkpoint {out / 'step_000050'}")
