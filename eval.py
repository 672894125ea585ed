"""Evaluation: bits per byte, multiple-choice scoring as lm-evaluation-harness does it, pass@k, exact match.

    python eval.py out/small                                   # bits per byte on the run's held-out split
    python eval.py out/small --tasks=bpb,hellaswag,arc_easy,piqa --limit=500 --num_fewshot=5
    python eval.py models/Llama-3.2-1B --tasks=hellaswag=data/hellaswag/ --add_bos    # a local copy
    python eval.py out/sft --tasks=humaneval --n_samples=10 --temperature=0.8 --pass_k=1,10
    python eval.py out/sft --tasks=gsm8k=data/gsm8k/test.jsonl --chat_template=False   # the base-model protocol
    torchrun --nproc_per_node=2 eval.py out/small --tasks=bpb,gsm8k --tp=2       # any layout

The model: a run folder (its newest checkpoint), a checkpoint folder or an HF model folder; our
checkpoints bring their config (model shape, tokenizer, corpus), so nothing is repeated. Layouts as
in training (parallel.parallelize): TP and FSDP models work (FSDP generates inside
Parallel.full_params()). Tasks (--tasks, comma separated; `name=source` for local data): bpb,
hellaswag, arc_easy, arc_challenge, piqa, mc, gsm8k, humaneval; what each reads, prompts and
scores: the comment above evaltasks.TASKS. --micro_batch_size: sequences per scoring forward;
--gen_batch_size: prompts per decode call. A chat model (a chat stage's checkpoint: its config names
its template; an HF folder with a chat template) is asked in its template, as lm-eval's
--apply_chat_template --fewshot_as_multiturn asks it (chat_setup); --chat_template=False: the base
model's protocol. Output: a table on stdout and a results JSON (--results, default
out/eval/<model>.json), never overwritten (a taken default name is numbered: <model>_2.json); both
name the protocol.

This file holds the CLI and runs the tasks; evaltasks.py builds them (formats, data, prompts, as
lm-eval does) and scoring.py scores the answers. Invariants: the numbers do not depend on the layout (examples are split
over data-parallel ranks in whole batches: scoring.py); prompts, few-shot draws and scores are
lm-eval's (tests/test_eval.py checks equality with lm-eval).
"""
import json
import os
import re
import sys
import time
from dataclasses import fields
from types import SimpleNamespace

import torch

import chat
import checkpoint
import config
import data
import hf
import lifecycle
import parallel
import tokenizer
import weights
from corpora import corpus
from memory import chunked
from model import ModelConfig, Transformer
from parallelism import pp
from posttrain import tasks
from tools import evaltasks, scoring
from tools.scoring import EvalError

EVAL_DEFAULTS = dict(
    tasks="bpb",           # comma separated: bpb, hellaswag, arc_easy, arc_challenge, piqa, mc, gsm8k, humaneval;
                           # name=source: a .jsonl/.json/.parquet file, a folder of <split>.jsonl, hf:<name>[:<config>]
    limit=0,               # at most this many examples per task (0: all)
    num_fewshot=-1,        # -1: each task's lm-eval default (0; gsm8k 5)
    fewshot_seed=1234,     # lm-eval's default fewshot_random_seed
    add_bos=False,         # start every sequence with the tokenizer's BOS (lm-eval does where HF's tokenizer adds it)
    bpb_data="",           # "": the run's held-out split (its data, tokenizer, val_fraction); else any corpus (--data)
    bpb_tokens=1 << 20,    # tokens scored for bits per byte (0: all)
    n_samples=1,           # generations per problem (pass@k needs k <= n_samples)
    pass_k="1",            # pass@k reported, comma separated
    temperature=0.0,       # generation: 0 greedy
    top_p=1.0,
    max_new_tokens=0,      # 0: each task's default (gsm8k 256 as lm-eval, humaneval 512)
    gen_batch_size=16,     # prompts per decode call
    code_timeout=10.0,     # seconds per HumanEval program in the sandbox
    code_workers=4,        # sandbox processes
    results="",            # results JSON, never overwritten ("": out/eval/<model>.json, <model>_2.json, ... when taken)
    chat_template="auto",  # auto: a chat model's own template (a chat stage's checkpoint, an HF folder with one), else
                           # none | False: the base-model protocol | default (ours) | a .jinja file
)
# the keys eval.py reads (config.load(extra=...); from a checkpoint, CKPT_KEYS too): the model's, where it comes
# from, its tokenizer, the processes and the layout (parallelize; the chunked loss scores), the corpus of bits per
# byte, its own. The training keys parallelize reads besides these (LoRA's, recompute's, ...) keep their defaults
EXTRA = config.Keys({"init_from": lifecycle.RUN_DEFAULTS["init_from"]}, (tokenizer.TOKENIZER_DEFAULTS, tokenizer.check),
                    (parallel.PARALLEL_DEFAULTS, parallel.check), pp.PP_DEFAULTS,
                    (chunked.CHUNKED_DEFAULTS, chunked.check), data.DATA_DEFAULTS, EVAL_DEFAULTS, instead={
                        "task": "eval.py runs tasks (comma separated: bpb, hellaswag, gsm8k, ...)",
                        "chat_data": "eval.py reads a task's examples from tasks=name=source"})
# what a checkpoint's config.json contributes: the model's shape, its tokenizer, its corpus and split
CKPT_KEYS = [f.name for f in fields(ModelConfig) if f.name not in ("dropout", "grad_checkpoint", "init_std")] + [
    "tokenizer", "tokenizer_vocab", "tokenizer_fim", "fim_rate", "fim_spm_rate", "fim_seed", "data", "text_field", "data_dir",
    "val_fraction", "val_tokens", "max_docs", "clean", "dedup", "seq_len", "fim_fragment", "toxicity",
    "toxicity_threshold", "toxicity_keep", "data_sources", "join_docs"]
CODE_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Codex's (Chen et al. 2021)
GSM8K_STOPS = ("Question:", "</s>", "<|im_end|>")              # lm-eval's gsm8k `until`


# ----------------------------------------------------------------------------- bits-per-byte windows

def corpus_windows(tok, source, T, max_tokens=0, text_field="text"):
    """Any corpus (corpus.iter_documents' sources) as token windows of T + 1 (consecutive windows share
    one token): the stream is EOS, doc, EOS, doc, ..., so every text token is a target; the last
    window may be shorter."""
    stream = [tok.eos_id]
    for doc in corpus.iter_documents(source, text_field):
        stream += tok.encode(doc) + [tok.eos_id]
        if max_tokens and len(stream) > max_tokens:
            stream = stream[:max_tokens + 1]
            break
    return [stream[i:i + T + 1] for i in range(0, len(stream) - 1, T)]


def split_windows(cfg, grid, tok, T):
    """The run's validation split (prepared as pretraining prepares it, if not yet; of streamed shards,
    the first set's, a remote one downloaded into the run folder's val/) as windows of T + 1 tokens,
    in data.eval_batches' order, at most bpb_tokens / T of them."""
    run_dir = os.path.dirname(os.path.abspath(cfg.init_from))  # a checkpoint's folder: step_N in the run folder
    path = data.validation_split(cfg, grid, tok, os.path.join(run_dir, "val"))
    n = cfg.bpb_tokens // T if cfg.bpb_tokens else 0
    if cfg.bpb_tokens and n == 0:
        raise EvalError(f"bpb_tokens={cfg.bpb_tokens} is less than one window of T={T} tokens: raise it")
    return [x[0].tolist() + [int(y[0, -1])] for x, y in data.eval_batches(path, 1, T, 0, 1, n)]


# ----------------------------------------------------------------------------- the CLI

def checkpoint_folder(path):
    """A checkpoint folder, or a run folder's newest checkpoint."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    found = checkpoint.latest(path)
    if found is None:
        raise EvalError(f"'{path}' is neither an HF model folder, a checkpoint folder (step_N) nor a run folder "
                        "with checkpoints")
    return found


def load_config(argv):
    """cfg: the training keys, EVAL_DEFAULTS, then (our checkpoint) its model, tokenizer and corpus keys,
    then the command line; an HF folder's config.json sets the model keys (weights.configure)."""
    args = list(argv)
    if args and not args[0].startswith("--") and not args[0].endswith(".py"):  # a leading folder: the model
        args[0] = f"--init_from={args[0]}"  # (a leading .py file is a config file)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = config.Keys(EXTRA, dict(micro_batch_size=8, batch_size=8 * world))  # micro_batch_size: rows a forward
    if "--help" in args or "-h" in args:  # the keys, their defaults and comments; exits
        config.load(["--help"], extra=extra, script=os.path.abspath(__file__))
    init = next((a.partition("=")[2] for a in args if a.startswith("--init_from=")), "")
    if not init:
        raise EvalError("name the model: python eval.py <run folder | checkpoint folder | HF folder> [--key=value ...] "
                        "(--help lists the keys)")
    if not os.path.isdir(init):
        raise config.MissingFileError(f"model folder '{init}' not found")
    if not hf.is_hf_folder(init):
        init = checkpoint_folder(init)
        saved = hf.read_config(init)
        extra.update({k: saved[k] for k in CKPT_KEYS if k in saved})
        args = [a for a in args if not a.startswith("--init_from=")] + [f"--init_from={init}"]
    cfg = config.load(args, extra=extra)
    weights.configure(cfg)
    return cfg


def model_tokenizer(cfg):
    """The tokenizer the model was trained with (chat_setup's)."""
    return chat_setup(cfg)[0]


def chat_setup(cfg):
    """(tokenizer, template or None): the tokenizer the model was trained with (tokenizer.for_cfg), with
    its chat template's special tokens (chat.setup, as sample.py --chat) when it has a template (a chat
    stage's checkpoint: its config names it; an HF folder's tokenizer_config) whose ids its vocabulary
    holds: generated chat ids decode, the end-of-turn id stops generation. The template is the prompts'
    (the chat protocol) unless chat_template=False; "default" or a .jinja file: that template instead
    (its tokens must be in the model's vocabulary)."""
    tok, given = tokenizer.for_cfg(cfg), str(cfg.chat_template)
    if hf.is_hf_folder(cfg.init_from):
        own = "" if getattr(tok, "chat_template", None) else None  # "": the folder's own (chat.template_for)
    else:
        own = hf.read_config(cfg.init_from).get("chat_template")  # the chat stage's setting
    name = own if given in ("auto", "False") else given
    if name is None:
        return tok, None
    chat_tok, template = chat.setup(SimpleNamespace(**{**chat.CHAT_DEFAULTS, **vars(cfg), "chat_template": name}))
    if chat_tok.n_vocab > cfg.vocab_size:
        if given not in ("auto", "False"):
            raise EvalError(f"--chat_template={given}: {template.name} writes {template.special_tokens}, which the "
                            f"model's vocabulary of {cfg.vocab_size} ids lacks (not fine-tuned in it): drop the key")
        return tok, None
    return chat_tok, None if given == "False" else template


def protocol(template):
    """What the results say of how the model was asked."""
    return f"chat: {template.name}, few-shot as multi-turn" if template else "base: no chat template"


def check_settings(cfg):
    """The evaluation keys' ranges (before anything is loaded)."""
    for ok, msg in [
        (cfg.limit >= 0, f"limit={cfg.limit} must be >= 0 (0: every example)"),
        (cfg.num_fewshot >= -1, f"num_fewshot={cfg.num_fewshot} must be >= 0, or -1 (the task's default)"),
        (cfg.n_samples >= 1, f"n_samples={cfg.n_samples} must be >= 1"),
        (cfg.temperature >= 0, f"temperature={cfg.temperature} must be >= 0 (0: greedy)"),
        (0 < cfg.top_p <= 1, f"top_p={cfg.top_p} must be in (0, 1]"),
        (cfg.max_new_tokens >= 0, f"max_new_tokens={cfg.max_new_tokens} must be >= 0 (0: the task's default)"),
        (cfg.bpb_tokens >= 0, f"bpb_tokens={cfg.bpb_tokens} must be >= 0 (0: all)"),
        (cfg.gen_batch_size >= 1 and cfg.code_workers >= 1, f"gen_batch_size={cfg.gen_batch_size} and "
         f"code_workers={cfg.code_workers} must be >= 1"),
        (cfg.code_timeout > 0, f"code_timeout={cfg.code_timeout} must be > 0 (seconds)")]:
        if not ok:
            raise EvalError(msg)


def parse_tasks(cfg):
    out = []
    for item in filter(None, (s.strip() for s in cfg.tasks.split(","))):
        name, _, source = item.partition("=")
        if name not in evaltasks.TASKS:
            known = ", ".join(evaltasks.TASKS)
            raise EvalError(f"unknown task '{name}': choose from {known} (name=source for local data)")
        out.append((name, source))
    ks = [int(k) for k in str(cfg.pass_k).split(",") if k.strip()]
    if any(k < 1 or k > cfg.n_samples for k in ks):
        raise EvalError(f"pass_k={cfg.pass_k}: each k must be in [1, n_samples={cfg.n_samples}]")
    return out, ks


def load_model(cfg, grid):
    """Transformer of cfg's shape, laid out by parallel.parallelize (the training keys eval does not take at
    their defaults: no LoRA, no recompute, ...), weights from cfg.init_from."""
    torch.manual_seed(cfg.seed)
    cfg = SimpleNamespace(**{**lifecycle.TRAIN, **vars(cfg)})
    raw = Transformer(ModelConfig.from_cfg(cfg)).to(grid.device)
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid), optimizer=False)
    raw.eval()
    return net


def new_tokens(cfg, default):
    """--max_new_tokens, else the task's default up to half the context."""
    return cfg.max_new_tokens or min(default, cfg.block_size // 2)


def run_task(name, source, cfg, net, tok, autocast, ks, template=None):
    """One task -> its metrics (every rank gets them); template: the chat protocol's (chat_setup)."""
    spec = evaltasks.TASKS[name]
    if spec.kind == "bpb":
        T = cfg.seq_len or cfg.block_size
        windows = (corpus_windows(tok, cfg.bpb_data, T, cfg.bpb_tokens, cfg.text_field) if cfg.bpb_data
                   else split_windows(cfg, net.grid, tok, T))
        return scoring.bits_per_byte(net, tok, windows, cfg.micro_batch_size, autocast)
    if spec.kind == "code":  # pass@k: n completions of each code_prompt, cut at Codex's stops, judged on rank 0
        items = tasks.human_eval()[:cfg.limit or None]
        prompts = [evaltasks.chat_prompt(template, [], it["code_prompt"]) if template else it["code_prompt"]
                   for it in items]
        texts = scoring.generate_texts(net, tok, prompts, new_tokens(cfg, 512), n=cfg.n_samples,
                                       temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, stops=CODE_STOPS,
                                       batch_size=cfg.gen_batch_size, autocast=autocast, template=template)
        return parallel.on_main(net.grid, lambda: scoring.code_scores(items, texts, ks, cfg.code_timeout,
                                                                      cfg.code_workers)[0])
    # rank 0 reads the data (a hub download once), every rank gets the prompts; a bad record stops all
    docs, contexts = parallel.on_main(net.grid, lambda: evaltasks.task_prompts(name, source, cfg, template))
    if spec.kind == "mc":
        return scoring.multiple_choice(net, tok, docs, contexts, cfg.micro_batch_size, autocast, cfg.add_bos,
                                       template)[0]
    texts = scoring.generate_texts(net, tok, contexts, new_tokens(cfg, 256), temperature=cfg.temperature,
                                   top_p=cfg.top_p, seed=cfg.seed, stops=GSM8K_STOPS,
                                   batch_size=cfg.gen_batch_size, autocast=autocast, template=template)
    return scoring.gsm8k_scores([t[0] for t in texts], docs)[0]


def table(results, template=None):
    lines = [f"protocol: {protocol(template)}", f"{'task':<14} {'metric':<22} {'value':>10}"]
    for name, m in results.items():
        for k, v in m.items():
            if isinstance(v, float) and not k.endswith("_stderr"):
                se = m.get(f"{k}_stderr")
                se = f" ± {se:.4f}" if se is not None and se == se else ""
                lines.append(f"{name:<14} {k:<22} {v:>10.4f}{se}")
        lines.append(f"{'':<14} {'n' if 'n' in m else 'tokens':<22} {m.get('n', m.get('tokens')):>10}")
    return "\n".join(lines)


def check_results(cfg):
    """--results names a new file: results are never overwritten (before anything is evaluated)."""
    if cfg.results and os.path.exists(cfg.results):
        raise EvalError(f"--results={cfg.results} exists: eval.py never overwrites results; name a new file "
                        "(or leave --results out: out/eval/<model>.json, numbered when taken)")


def write_results(cfg, record):
    """The results JSON -> its path: --results, else out/eval/<model>.json, or <model>_2.json,
    <model>_3.json, ... when taken (each created exclusively: an earlier result is never replaced)."""
    stem = os.path.join("out", "eval", re.sub(r"[^\w.-]+", "_", cfg.init_from.strip("/")))
    paths = [cfg.results] if cfg.results else (stem + (f"_{i}" if i > 1 else "") + ".json" for i in range(1, 10 ** 6))
    for out in paths:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        try:
            with open(out, "x") as f:
                json.dump(record, f, indent=2)
            return out
        except FileExistsError:
            if cfg.results:
                check_results(cfg)
    raise EvalError(f"no free results file name next to {stem}.json")


def main(argv):
    t0 = time.perf_counter()
    cfg = load_config(argv)
    check_settings(cfg)
    check_results(cfg)
    todo, ks = parse_tasks(cfg)
    grid = parallel.init(cfg, cfg.threads)
    say = lifecycle.say(grid)
    tok, template = chat_setup(cfg)
    net = load_model(cfg, grid)
    autocast = parallel.autocast(cfg, grid.device)
    results, seconds = {}, {}
    for name, source in todo:
        t = time.perf_counter()
        results[name] = run_task(name, source, cfg, net, tok, autocast, ks, template)
        seconds[name] = round(time.perf_counter() - t, 2)
        say(f"{name}: done in {seconds[name]:.1f} s")
    say(table(results, template))
    if grid.is_main:
        settings = {k: getattr(cfg, k) for k in EVAL_DEFAULTS}
        out = write_results(cfg, {
            "model": cfg.init_from, "step": checkpoint.step_of(cfg.init_from), "world": grid.world, "tp": grid.tp,
            "data_parallel": cfg.data_parallel, "protocol": protocol(template),
            "chat_template": template.source if template else None, "results": results, "seconds": seconds,
            "total_seconds": round(time.perf_counter() - t0, 2), "settings": settings})
        say(f"results: {out}")
    return results


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])
