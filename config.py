"""Configs: a Python file of assignments, then --key=value overrides, then validation; per stage.

    python pretrain.py configs/tiny.py --lr=3e-4 --compile=True --data=/path/to/corpus
    python sft.py --help                       # this stage's keys, with defaults and one-line comments

A stage accepts the keys it reads: the model's (model.ModelConfig), the shared ones below (every
stage reads them) and its own (`load(argv, extra=...)`: data.DATA_DEFAULTS and pretrain's sample
keys for pretraining, chat.CHAT_DEFAULTS and the stage's for SFT / DPO / GRPO, eval's for eval.py).
An override is parsed as a Python literal and must have the default's type. The result is a flat
namespace `cfg`, printed once and saved into every checkpoint; cfg.given holds the keys the user set.

A mistake the user must fix raises UserError (or a subclass that also keeps the built-in type
callers may catch: ConfigError is a ValueError, ...): cli() prints its message once, without a
traceback.
"""
import ast
import difflib
import glob
import io
import json
import os
import sys
import time
import tokenize
import traceback
from dataclasses import asdict
from types import SimpleNamespace

import torch.distributed as dist

from model import ModelConfig


class UserError(Exception):
    """The user must fix something (a setting, a path, a file): printed once, without a traceback."""


class DataError(UserError, ValueError):
    """A problem with the data or data settings a user gave: the message says what is wrong and what to change."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work."""


def need(ok, msg):
    """Raise ConfigError(msg) unless ok: a check() reads as its list of conditions and messages."""
    if not ok:
        raise ConfigError(msg)


class ConfigKeyError(UserError, KeyError):
    """An unknown config key."""

    def __str__(self):  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(UserError, TypeError):
    """A config value of the wrong type."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it should be)."""


# The keys every stage reads. Model keys come from ModelConfig; a stage adds its own (load(extra=...)).
SHARED_DEFAULTS = dict(
    # I/O
    out_dir="out/run",       # checkpoints and metrics (each stage has its own default)
    resume="",               # "": start fresh | "latest" (bare --resume): the newest complete checkpoint in
                             # out_dir, falling back past broken ones | a checkpoint (or run) folder
    overwrite=False,         # a fresh run into an out_dir holding an earlier run moves that run's files to
                             # out_dir/old_<time>/ (nothing is deleted); without it such a run refuses
    force_resume=False,      # resume even where settings changed that break exactness (RESUME_FREE below)
    init_from="",            # start from the weights of a checkpoint folder or a local HF model folder
    ckpt_every=500,          # steps between checkpoints (0: only at the end)
    keep_last=2,             # checkpoints kept on disk
    tokenizer="cl100k_base",  # a bundled BPE (cl100k_base, o200k_base), a cached tiktoken name, or an HF folder
    tokenizer_vocab=0,       # >0: keep only the first N tokens of the BPE (small models)
    tokenizer_fim=False,     # FIM sentinels at the top of a truncated vocabulary (pretraining: fim_rate > 0)
    # batch: batch_size sequences per optimizer step, split over data-parallel ranks and
    # gradient-accumulation micro-steps of micro_batch_size sequences each
    batch_size=32,           # sequences (SFT: rows, DPO: pairs, GRPO: completions) per optimizer step
    micro_batch_size=8,      # sequences per forward on one rank (the rest is gradient accumulation)
    seq_len=0,               # 0 -> block_size
    # optimization
    max_steps=1000,          # optimizer steps (the schedule's length)
    stop_at=0,               # stop early at this step, e.g. to fit a job time limit (0: run to max_steps)
    optimizer="adamw",       # adamw | muon (hidden matrices; the rest AdamW)
    lr=6e-4,                 # peak learning rate (after warmup)
    min_lr_ratio=0.1,        # final lr = lr * min_lr_ratio
    schedule="cosine",       # cosine | linear | wsd | constant (all after linear warmup)
    warmup_steps=100,        # linear warmup from 0
    wsd_decay_frac=0.2,      # WSD: fraction of steps spent decaying at the end
    weight_decay=0.1,        # decoupled, on matrices only (optim.py)
    beta1=0.9,               # AdamW's first-moment decay
    beta2=0.95,              # AdamW's second-moment decay
    eps=1e-8,                # AdamW's denominator floor
    grad_clip=1.0,           # 0: no clipping
    # Muon (optimizer="muon"): hidden matrices; embeddings, head, norms, biases stay on AdamW
    muon_lr=0.0,             # 0 -> lr (with muon_scale="rms" AdamW's lr and weight decay carry over)
    muon_momentum=0.95,      # Nesterov momentum
    muon_scale="rms",        # rms: update * 0.2*sqrt(max(rows, cols)) | shape: * sqrt(max(1, rows/cols))
    ns_dtype="bfloat16",     # Newton-Schulz precision: bfloat16 (float32 on GPUs without bf16) | float32 (exact tests)
    zero1=False,             # ZeRO-1: optimizer state sharded over data-parallel ranks (ddp only)
    # system
    seed=1337,               # weights, data order and sampling follow from it
    device="auto",           # auto | cpu | cuda
    dtype="auto",            # auto (bf16 on GPUs with it, float16 on GPUs without, fp32 on CPU) | float32 | bfloat16 |
                             # float16 (with loss scaling: scaler.py)
    compile=False,           # torch.compile the model (the whole model under ddp, each block under fsdp)
    threads=0,               # CPU threads per process (0: the cores / local processes; said at start-up)
    grad_bucket_mb=25.0,     # data-parallel all-reduce bucket size
    grad_reduce_dtype="float32",  # ddp: gradients travel as float32 | bfloat16 (half the bytes, rounded)
    tp=1,                    # tensor-parallel size (Megatron style, innermost: neighbouring GPUs)
    sequence_parallel=False,  # tp > 1: norms, residual and dropout on T/tp positions (tp.py); dense, ddp
    data_parallel="ddp",     # how the world // tp replicas split the batch: ddp (replicated) | fsdp (sharded)
    ep=1,                    # expert-parallel size: experts sharded over ep ranks that see different data (moe.py)
    pp=1,                    # pipeline stages (pp.py): blocks cut into pp stages, outermost in the grid
    pp_schedule="1f1b",      # 1f1b (<= pp micro-batches' activations in flight per stage) | gpipe (all of them)
    pp_cut="",               # where stages 1.. start, e.g. "3,5" for pp=3 ("": blocks split evenly)
    pp_micro=0,              # micro-batches per step and data rank (0: batch_size / (micro_batch_size x data
                             # ranks)); > 0 sets micro_batch_size to batch_size / (pp_micro x data ranks)
    # LoRA (lora.py): lora_r > 0 freezes the base and trains rank-r adapters
    lora_r=0,                # adapter rank (0: no LoRA)
    lora_alpha=16.0,         # adapter scale alpha / r
    lora_dropout=0.0,        # dropout on the adapters' input
    lora_targets="all-linear",  # "all-linear" (attention + MLP) or HF module names: "q_proj,v_proj" (GPT-2: c_attn, ...)
    lora_rslora=False,       # scale alpha / sqrt(r) instead of alpha / r
    lora_base_dtype="float32",  # float32 | bfloat16 | nf4: the frozen base's storage (bf16 needs bf16 autocast;
                                # nf4: 4-bit QLoRA, qlora.py, computed in bf16 or fp16)
    qlora_double=True,       # nf4: the block scales quantised too (double quantisation, 0.127 bits per weight)
    lora_train_tokens=True,  # LoRA: the embedding/head rows of tokens added to init_from's vocabulary (the chat template's) train too, as PEFT's trainable_token_indices
    # memory (README's "Memory on 24 GB cards"; gpu_memory says which of them a run needs)
    loss_chunk=0,            # >0: the loss in chunks of N tokens from the last hidden state, no logits held (chunked.py)
    recompute="",            # "" | block | attn | mlp: recompute that part of blocks in backward (recompute.py)
    recompute_every=1,       # recompute only blocks 0, k, 2k, ... (k = recompute_every)
    offload_activations=False,  # the inputs recomputed parts keep wait in pinned host memory (recompute.py)
    embed_on_host=False,     # LoRA: the frozen token embedding stays in host memory, rows looked up there (materialize.py)
    adamw_state="fp32",      # fp32 | 8bit (block-wise 8-bit moments) | offload (state on the CPU): optim_memory.py
    optimizer_in_backward=False,  # each parameter updated as its gradient arrives, which is then freed (one GPU,
                                  # one micro-batch a step, grad_clip=0): optim_memory.InBackwardAdamW
    gpu_memory=0.0,          # >0: print the memory plan (plan.py) for GPUs of this many GiB, what fits, and exit
    # evaluation and logging
    eval_every=250,          # steps between held-out evaluations (0: none)
    log_every=10,            # steps between log lines
    progress=True,           # tqdm bar on rank 0
    peak_tflops=0.0,         # per-GPU peak for MFU; 0 -> look up the GPU in a table
    tensorboard=False,       # also log to out_dir/tb (needs tensorboard)
    wandb=False,             # also log to Weights & Biases (needs wandb)
    wandb_project="ingot",   # the W&B project
    mlflow=False,            # also log to MLflow (needs mlflow): params, metrics, config and PNGs as artifacts
    mlflow_uri="",           # MLflow tracking URI, e.g. sqlite:///mlflow.db ("": MLflow's default, MLFLOW_TRACKING_URI)
    mlflow_experiment="ingot",  # the MLflow experiment
    # gradient statistics (gradstats.py): logged on their own steps, read by plots.py --heatmap
    grad_stats_every=0,      # >0: per-layer/kind grad norms, update ratios, activation stats every N steps (0: none)
    ratio_low=1e-5,          # a warning when a layer's update ratio stays below ratio_low ...
    ratio_high=1e-1,         # ... or above ratio_high ...
    ratio_patience=3,        # ... for this many statistics steps in a row
    act_saturate=6.0,        # an activation counts as saturated at |x| >= act_saturate
    act_dead_eps=0.0,        # a channel counts as dead where |x| <= act_dead_eps on every token of the step
)


# Shared settings a resumed run may change freely: they do not alter the math of the steps to come
# (layout, precision and speed knobs, logging, evaluation, checkpoint cadence, paths). Any other
# changed key (model, data, batch_size, seq_len, optimizer, lr, schedule, max_steps, seed, ...)
# makes the continued run differ from an uninterrupted one: resume refuses it unless
# --force_resume=True. A key unknown here counts as one that matters; a stage names its own
# free keys (lifecycle.claim(free=...)).
RESUME_FREE = frozenset("""
    out_dir init_from ckpt_every keep_last stop_at
    device dtype compile threads grad_bucket_mb grad_reduce_dtype tp sequence_parallel data_parallel ep zero1
    pp pp_schedule pp_cut pp_micro
    micro_batch_size ns_dtype grad_checkpoint fp32_residual loss_chunk recompute recompute_every offload_activations
    embed_on_host
    optimizer_in_backward gpu_memory
    eval_every log_every progress peak_tflops tensorboard wandb wandb_project mlflow mlflow_uri mlflow_experiment
    grad_stats_every ratio_low ratio_high ratio_patience act_saturate act_dead_eps
""".split())
RESUME_CONTROL = frozenset({"resume", "overwrite", "force_resume"})  # how to start, not settings
# a bare --key (no =value) for keys that are not bool
BARE_FLAG = {"resume": "latest"}


class Config(SimpleNamespace):
    """The flat namespace of a run's settings; `given` (not a setting: not in vars(cfg)) holds the
    keys the config file or the command line set."""
    __slots__ = ("given",)


def defaults(extra=None):
    d = {**asdict(ModelConfig()), **SHARED_DEFAULTS}
    d.update(extra or {})
    return d


def _unknown(key, valid):
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    owner = key_owner(key)
    where = f" ('{key}' is a setting of {owner}, not of this stage)" if owner else ""
    return ConfigKeyError(f"unknown config key '{key}'.{where}{hint} (--help lists this stage's keys)")


def _check_type(key, value, default):
    if key == "resume" and isinstance(value, bool):  # resume=True in a file or --resume=True: the newest
        value = BARE_FLAG[key] if value else ""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigTypeError(f"config key '{key}' must be {type(default).__name__} (default {default!r}), "
                              f"got {value!r} of type {type(value).__name__}")
    return value


def parse_override(arg, d):
    """'--key=value' -> (key, value): value is a Python literal of the default's type.
    Strings need no quotes (--data=/my/corpus); '--flag' alone means True (BARE_FLAG's value
    for the string keys it lists: bare --resume is --resume=latest)."""
    if not arg.startswith("--"):
        raise ConfigError(f"expected --key=value, got '{arg}'")
    key, eq, raw = arg[2:].partition("=")
    key = key.replace("-", "_")
    if key not in d:
        raise _unknown(key, list(d))
    if not eq:
        if isinstance(d[key], bool):
            return key, True
        if key in BARE_FLAG:
            return key, BARE_FLAG[key]
        raise ConfigError(f"'--{key}' needs a value: --{key}=...")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare string
    if isinstance(d[key], str) and not isinstance(value, str) and not (key == "resume" and isinstance(value, bool)):
        value = raw  # a string key takes the text as written (--resume=True/False are _check_type's)
    return key, _check_type(key, value, d[key])


def read_file(path, d):
    """Execute a config file (plain Python) and keep its public assignments; it may import another's keys
    (`from configs.tiny import data`: the stage scripts' folder is on sys.path)."""
    return {key: _known(key, value, d) for key, value in _assignments(path).items()}


def _assignments(path):
    if not os.path.isfile(path):
        raise MissingFileError(f"config file '{path}' not found (configs live in configs/, e.g. configs/tiny.py)")
    scope = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return {k: v for k, v in scope.items()
            if not (k.startswith("_") or callable(v) or type(v).__name__ == "module")}


def _known(key, value, d):
    if key not in d:
        raise _unknown(key, list(d))
    return _check_type(key, value, d[key])


def load(argv, extra=None, world=None, script=None, example=None, plugins=None):
    """argv: [config_file.py] [--key=value ...] -> validated Config. extra: the stage's own keys and
    defaults (they override the shared ones). --help prints the stage's keys and exits; no argument
    at all asks for a config (example: the one to suggest) instead of running the defaults.
    plugins (a stage with model families, weights.objective_keys / variant_keys): plugins(values,
    unknown) -> (the chosen family's keys and defaults, its model check or None: the decoder's), from
    the values as read (file, then command line; the stage's keys typed) and the given keys the stage lacks;
    its keys join the stage's. plugins(None, set()): every family's keys (--help lists them)."""
    d = defaults(extra)
    args = list(argv)
    name = os.path.basename(script or sys.argv[0] or "the script")
    if "--help" in args or "-h" in args:
        more = plugins(None, set())[0] if plugins else {}
        print(help_text({**d, **more}, {**(extra or {}), **more}, name))
        raise SystemExit(0)
    if not args and example:
        raise UserError(f"no config: give one, e.g. `python {name} {example}`, or --key=value settings to run the "
                        f"defaults (a {d['n_layer']}-layer, {d['n_embd']}-wide model); --help lists the keys")
    file = _assignments(args.pop(0)) if args and not args[0].startswith("--") else {}
    model = None
    if plugins:  # the family the values choose: its keys (and their defaults) join the stage's
        read = dict(file)
        for a in args:
            key = a[2:].partition("=")[0].replace("-", "_")
            read[key] = parse_override(a, d)[1] if key in d else None
        more, model = plugins({**d, **read}, set(read) - set(d))
        d.update(more)
    values, given = dict(d), set(file)
    values.update({k: _known(k, v, d) for k, v in file.items()})
    for a in args:
        k, v = parse_override(a, d)
        values[k] = v
        given.add(k)
    cfg = Config(**values)
    cfg.given = given
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world is None else world, model)
    return cfg


def validate(cfg, world=1, model=None):
    """The shared keys and the model's: fail early, with a message that says what to change. model(cfg):
    the model config's checks (default ModelConfig's; another family's: weights.Family.model_config).
    Stages check their own keys (their check()); call this again after cfg's model keys change."""
    try:
        (model or ModelConfig.from_cfg)(cfg)  # model checks (heads divide width, known activation, ...)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e
    need(cfg.lr > 0, f"lr={cfg.lr} must be positive")
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    need(cfg.max_steps > 0, f"max_steps={cfg.max_steps} must be positive")
    need(0 <= cfg.stop_at <= cfg.max_steps, f"stop_at={cfg.stop_at} must be in [0, max_steps={cfg.max_steps}]")
    need(cfg.warmup_steps >= 0, f"warmup_steps={cfg.warmup_steps} must be >= 0")
    need(cfg.schedule in ("cosine", "linear", "wsd", "constant"),
         f"schedule='{cfg.schedule}' is not one of cosine, linear, wsd, constant")
    need(0 < cfg.wsd_decay_frac <= 1, f"wsd_decay_frac={cfg.wsd_decay_frac} must be in (0, 1]")
    need(cfg.weight_decay >= 0, f"weight_decay={cfg.weight_decay} must be >= 0")
    need(0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1, f"beta1={cfg.beta1}, beta2={cfg.beta2} must be in [0, 1)")
    need(cfg.grad_clip >= 0, f"grad_clip={cfg.grad_clip} must be >= 0 (0 disables clipping)")
    need(cfg.optimizer in ("adamw", "muon"), f"optimizer='{cfg.optimizer}' is not available (choose adamw or muon)")
    need(cfg.muon_lr >= 0, f"muon_lr={cfg.muon_lr} must be >= 0 (0 means lr)")
    need(0 <= cfg.muon_momentum < 1, f"muon_momentum={cfg.muon_momentum} must be in [0, 1)")
    need(cfg.muon_scale in ("rms", "shape"), f"muon_scale='{cfg.muon_scale}' must be rms or shape")
    need(cfg.ns_dtype in ("bfloat16", "float32"), f"ns_dtype='{cfg.ns_dtype}' must be bfloat16 or float32")
    need(not (cfg.zero1 and cfg.data_parallel == "fsdp"),
         "zero1=True shards optimizer state over ddp replicas; data_parallel='fsdp' already shards it: drop one")
    need(cfg.device in ("auto", "cpu", "cuda"), f"device='{cfg.device}' must be auto, cpu or cuda")
    need(cfg.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"dtype='{cfg.dtype}' must be auto, float32, bfloat16 or float16")
    need(cfg.threads >= 0, f"threads={cfg.threads} must be >= 0 (0: the cores divided among the local processes)")
    need(cfg.tp >= 1, f"tp={cfg.tp} must be >= 1")
    need(cfg.ep >= 1, f"ep={cfg.ep} must be >= 1")
    need(cfg.ep == 1 or cfg.n_experts > 0, f"ep={cfg.ep} shards experts: set n_experts > 0 (a MoE model) or ep=1")
    need(cfg.n_experts % cfg.ep == 0, f"n_experts={cfg.n_experts} is not divisible by ep={cfg.ep}: each rank needs whole experts")
    need(cfg.grad_reduce_dtype in ("float32", "bfloat16"),
         f"grad_reduce_dtype='{cfg.grad_reduce_dtype}' must be float32 or bfloat16")
    need(cfg.data_parallel in ("ddp", "fsdp"), f"data_parallel='{cfg.data_parallel}' must be ddp or fsdp")
    need(not (cfg.compile and cfg.data_parallel == "fsdp" and cfg.tp > 1),
         "compile=True works with tp > 1 under data_parallel='ddp', and with data_parallel='fsdp' at tp=1; "
         "TP x FSDP compiled together is untested: set --compile=False or --data_parallel=ddp")
    need(not cfg.sequence_parallel or (cfg.data_parallel == "ddp" and not cfg.n_experts and not cfg.lora_r),
         "sequence_parallel=True works with dense models, data_parallel='ddp' and no LoRA only: "
         "set --sequence_parallel=False")
    need(not cfg.sequence_parallel or (cfg.seq_len or cfg.block_size) % cfg.tp == 0,
         f"sequence_parallel=True: the sequence length {cfg.seq_len or cfg.block_size} (seq_len, or block_size) "
         f"must be divisible by tp={cfg.tp}")
    need(cfg.n_head % cfg.tp == 0, f"n_head={cfg.n_head} is not divisible by tp={cfg.tp}: each rank needs whole heads")
    need(cfg.pp >= 1, f"pp={cfg.pp} must be >= 1")
    need(world % (cfg.pp * cfg.tp * cfg.ep) == 0,
         f"world size {world} is not divisible by pp*tp*ep={cfg.pp * cfg.tp * cfg.ep}")
    dp = world // (cfg.pp * cfg.tp * cfg.ep) * cfg.ep  # data-parallel ranks: EP ranks see different data too
    _check_pipeline(cfg, dp, need)
    need(cfg.micro_batch_size > 0 and cfg.batch_size > 0, "batch_size and micro_batch_size must be positive")
    need(cfg.batch_size % (cfg.micro_batch_size * dp) == 0,
         f"batch_size={cfg.batch_size} must be divisible by micro_batch_size*data_parallel="
         f"{cfg.micro_batch_size}*{dp}={cfg.micro_batch_size * dp}: change batch_size or micro_batch_size")
    need(0 <= cfg.seq_len <= cfg.block_size, f"seq_len={cfg.seq_len} must be in [0, block_size={cfg.block_size}] (0 means block_size)")
    need(cfg.keep_last >= 1, f"keep_last={cfg.keep_last} must be >= 1")
    need(cfg.ckpt_every >= 0 and cfg.eval_every >= 0 and cfg.log_every > 0,
         "ckpt_every and eval_every must be >= 0 and log_every > 0")
    need(cfg.tokenizer_vocab == 0 or cfg.tokenizer_vocab >= 257,
         f"tokenizer_vocab={cfg.tokenizer_vocab} must be 0 (full BPE) or >= 257 (256 bytes + EOS)")
    need(cfg.peak_tflops >= 0, f"peak_tflops={cfg.peak_tflops} must be >= 0")
    need(cfg.lora_r >= 0, f"lora_r={cfg.lora_r} must be >= 0 (0: no LoRA)")
    need(cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1,
         f"lora_alpha={cfg.lora_alpha} must be > 0 and lora_dropout={cfg.lora_dropout} in [0, 1)")
    need(cfg.lora_base_dtype in ("float32", "bfloat16", "nf4"),
         f"lora_base_dtype='{cfg.lora_base_dtype}' must be float32, bfloat16 or nf4")
    need(cfg.loss_chunk >= 0, f"loss_chunk={cfg.loss_chunk} must be >= 0 (0: the logits are materialised)")
    need(cfg.recompute in ("", "block", "attn", "mlp"), f"recompute='{cfg.recompute}' must be '', block, attn or mlp")
    need(cfg.recompute_every >= 1, f"recompute_every={cfg.recompute_every} must be >= 1")
    need(not (cfg.recompute and cfg.grad_checkpoint),
         f"recompute='{cfg.recompute}' and grad_checkpoint=True both recompute (grad_checkpoint is recompute='block' "
         f"on every block): drop one")
    need(not cfg.offload_activations or cfg.recompute or cfg.grad_checkpoint,
         "offload_activations=True moves what recomputed blocks keep to the host: set grad_checkpoint=True or "
         "recompute")
    need(not cfg.embed_on_host or (cfg.lora_r and not cfg.tie_embeddings and cfg.tp == 1 and cfg.pp == 1
                                   and cfg.data_parallel == "ddp"),
         "embed_on_host=True keeps a frozen, untied token embedding on the host: it needs lora_r > 0, "
         "tie_embeddings=False, tp=1, pp=1 and data_parallel=ddp")
    inb = "optimizer_in_backward=True updates each parameter during backward"
    need(not cfg.optimizer_in_backward or world == 1, f"{inb}, before other ranks' gradients could be summed: one "
         f"process only (this run has {world})")
    need(not cfg.optimizer_in_backward or cfg.grad_clip == 0, f"{inb}, before the norm of all gradients exists: "
         f"set grad_clip=0 (now {cfg.grad_clip})")
    need(not cfg.optimizer_in_backward or cfg.batch_size <= cfg.micro_batch_size, f"{inb}: gradients cannot "
         f"accumulate over micro-batches; set micro_batch_size >= batch_size={cfg.batch_size}")
    need(not cfg.optimizer_in_backward or (cfg.optimizer == "adamw" and cfg.adamw_state == "fp32" and not cfg.zero1
                                           and cfg.data_parallel == "ddp" and cfg.dtype != "float16"
                                           and not cfg.grad_stats_every),
         f"{inb}: AdamW with fp32 state and data_parallel='ddp' only, not with fp16 loss scaling (which may skip "
         f"a step) or grad_stats_every (which reads the gradients)")
    need(cfg.adamw_state in ("fp32", "8bit", "offload"),
         f"adamw_state='{cfg.adamw_state}' must be fp32, 8bit or offload")
    need(not (cfg.adamw_state != "fp32" and cfg.optimizer == "muon" and cfg.data_parallel == "fsdp"),
         f"adamw_state='{cfg.adamw_state}' works under FSDP with optimizer='adamw' only (FSDP + Muon keeps fp32 "
         f"AdamW state): set adamw_state='fp32' or optimizer='adamw'")
    need(cfg.gpu_memory >= 0, f"gpu_memory={cfg.gpu_memory} must be >= 0 (0: no plan; 24: plan for 24 GiB GPUs)")
    need(not cfg.lora_r or (cfg.optimizer == "adamw" and not cfg.zero1),
         "LoRA trains with AdamW, without zero1 (Muon is for full hidden matrices; the adapters' state is small): "
         "set optimizer='adamw', zero1=False")
    need(cfg.grad_stats_every >= 0, f"grad_stats_every={cfg.grad_stats_every} must be >= 0 (0: no gradient statistics)")
    need(0 < cfg.ratio_low < cfg.ratio_high, f"ratio_low={cfg.ratio_low}, ratio_high={cfg.ratio_high}: need "
         f"0 < ratio_low < ratio_high (the sane band of update ratios)")
    need(cfg.ratio_patience >= 1, f"ratio_patience={cfg.ratio_patience} must be >= 1")
    need(cfg.act_saturate > 0 and cfg.act_dead_eps >= 0,
         f"act_saturate={cfg.act_saturate} must be > 0 and act_dead_eps={cfg.act_dead_eps} >= 0")
    need(cfg.grad_bucket_mb > 0, f"grad_bucket_mb={cfg.grad_bucket_mb} must be positive")
    # found here, not after training: numpy's generators take seeds in [0, 2**32)
    need(0 <= cfg.seed < 2**32, f"seed={cfg.seed} must be in [0, 2**32)")


def _check_pipeline(cfg, dp, need):
    """The pipeline keys (pp.py). pp_micro > 0 sets micro_batch_size (the micro-batch count fixes its size)."""
    need(cfg.pp_schedule in ("1f1b", "gpipe"), f"pp_schedule='{cfg.pp_schedule}' must be 1f1b or gpipe")
    need(cfg.n_layer >= cfg.pp, f"pp={cfg.pp} stages need n_layer >= pp blocks (n_layer={cfg.n_layer})")
    need(not cfg.pp_cut or cfg.pp > 1, f"pp_cut='{cfg.pp_cut}' cuts a pipeline: set pp > 1, or pp_cut=''")
    if cfg.pp_cut:
        try:
            cut = [int(b) for b in cfg.pp_cut.split(",")]
        except ValueError:
            cut = None
        need(cut is not None and len(cut) == cfg.pp - 1 and all(0 < a < b < cfg.n_layer for a, b in
                                                                zip(cut, cut[1:] + [cfg.n_layer])),
             f"pp_cut='{cfg.pp_cut}' must be {cfg.pp - 1} increasing block indices in 1..{cfg.n_layer - 1}, "
             f"where stages 1..{cfg.pp - 1} start, e.g. pp_cut='{','.join(str(cfg.n_layer * s // cfg.pp) for s in range(1, cfg.pp))}'")
    need(cfg.pp == 1 or not cfg.n_experts, "pp > 1 works with dense models (n_experts=0): MoE router losses "
         "on every stage are not summed yet")
    need(cfg.pp == 1 or not cfg.compile, "pp > 1 with compile=True is untested: set --compile=False")
    need(cfg.pp == 1 or not cfg.grad_stats_every, f"grad_stats_every={cfg.grad_stats_every} works with pp=1 only "
         f"(a stage holds some layers): set --grad_stats_every=0 or pp=1")
    need(cfg.pp_micro >= 0, f"pp_micro={cfg.pp_micro} must be >= 0 (0: from the batch split)")
    if cfg.pp_micro:
        need(cfg.batch_size % (cfg.pp_micro * dp) == 0,
             f"batch_size={cfg.batch_size} must be divisible by pp_micro*data_parallel={cfg.pp_micro}*{dp}")
        mbs = cfg.batch_size // (cfg.pp_micro * dp)
        need("micro_batch_size" not in getattr(cfg, "given", ()) or cfg.micro_batch_size == mbs,
             f"pp_micro={cfg.pp_micro} sets micro_batch_size={mbs}: drop micro_batch_size={cfg.micro_batch_size}, "
             f"or pp_micro")
        cfg.micro_batch_size = mbs


def show(cfg):
    width = max(len(k) for k in vars(cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in sorted(vars(cfg).items()))


# ----------------------------------------------------------------------------- --help, from the source's comments

def _comments(path):
    """{key: its one-line comment} of a source file: the keywords of every `NAME_DEFAULTS = dict(...)`
    and the fields of ModelConfig, with the comment on their line (and comment-only lines that
    continue it)."""
    src = open(path, encoding="utf-8").read()
    notes, lines = {}, src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            notes[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}

    def add(key, line, end):
        text = [notes[line]] if line in notes else []
        nxt = end + 1  # comment-only lines right below, indented past the key: a continuation
        while nxt in notes and lines[nxt - 1].lstrip().startswith("#") and len(lines[nxt - 1]) - len(
                lines[nxt - 1].lstrip()) > len(lines[line - 1]) - len(lines[line - 1].lstrip()):
            text.append(notes[nxt])
            nxt += 1
        out.setdefault(key, " ".join(text))
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("DEFAULTS") and isinstance(node.value, ast.Call)):
            for kw in node.value.keywords:
                if kw.arg:
                    add(kw.arg, kw.value.lineno, kw.value.end_lineno)
        elif isinstance(node, ast.ClassDef) and node.name == "ModelConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    add(item.target.id, item.lineno, item.end_lineno)
    return out


NOT_WINGS = ("tests", "configs", "bench", "docker", "runs", "docs")  # folders whose .py files hold no keys


def _sources(script=None):
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(here, "*.py")) + glob.glob(os.path.join(here, "*", "*.py")))
    files = [f for f in files if os.path.basename(os.path.dirname(f)) not in NOT_WINGS]
    first = [os.path.abspath(script)] if script and os.path.isfile(script) else []
    return first + [f for f in files if f not in first]


def key_owner(key, script=None):
    """The file(s) whose *_DEFAULTS define `key` (for the message of a key this stage lacks), or ""."""
    here = os.path.abspath(script) if script else None
    owners = [os.path.basename(f) for f in _sources() if f != here and key in _comments(f)]
    return ", ".join(owners)


def help_text(d, extra, script):
    """Every key of a stage with its default and one-line comment, grouped: the stage's own, the
    shared ones, the model's."""
    notes = {}
    for path in _sources(script if os.path.isfile(str(script)) else None):
        for k, v in _comments(path).items():
            notes.setdefault(k, v)
    model = set(asdict(ModelConfig()))
    groups = [(f"{script}'s own keys", [k for k in d if k in (extra or {})]),
              ("shared keys (every stage)", [k for k in d if k in SHARED_DEFAULTS and k not in (extra or {})]),
              ("model keys (model.ModelConfig; from init_from when it is set)",
               [k for k in d if k in model and k not in (extra or {})])]
    out = [f"usage: python {script} [config.py] [--key=value ...]   (torchrun --nproc_per_node=N {script} ... "
           "for several processes)", "A config file is Python assignments of these keys; --key=value overrides it."]
    for title, keys in groups:
        if keys:
            out.append(f"\n{title}:")
            width = max(len(f"{k}={d[k]!r}") for k in keys)
            out += [f"  {f'{k}={d[k]!r}':<{width}}  {notes.get(k, '')}".rstrip() for k in keys]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the command line

def cli(main, argv):
    """Run a stage script's main(argv) so that a mistake the user must fix reads as one message.

    A UserError prints `error: <message>` once and exits with status 2, without a traceback: rank 0
    under torchrun (every rank meets the same error; the others leave quietly with status 0, so
    torchrun's own summary that follows names one failed process, and its error file carries the
    same line); `--debug` anywhere on the command line shows the traceback instead. Every other
    exception is a bug and keeps its traceback on every rank that hits it. The process group, if
    any, is destroyed on the way out.
    """
    debug = "--debug" in argv
    try:
        return main([a for a in argv if a != "--debug"])
    except UserError as e:
        if debug:
            raise
        if os.environ.get("RANK", "0") != "0":
            sys.exit(0)  # rank 0 reports it: torchrun's summary then names one failed process, not all
        print(f"error: {e}", file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary shows this instead of "no traceback"
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": {"message": f"error: {e}", "extraInfo": {
                    "py_callstack": f"error: {e}", "timestamp": str(int(time.time()))}}}, f)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves: lifecycle.Interrupt)
        if debug:
            traceback.print_exc()
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
