"""Configs: a Python file of assignments, then --key=value overrides, then validation.

    python pretrain.py configs/tiny.py --lr=3e-4 --compile=True --data=/path/to/corpus

Every key must exist in the defaults below (or in ModelConfig); an override is parsed as a
Python literal and must have the default's type. The result is a flat SimpleNamespace `cfg`
that is printed once and saved into every checkpoint.

A mistake the user must fix raises UserError (or a subclass that also keeps the built-in type
callers may catch: ConfigError is a ValueError, ...): the stage script prints its message once,
without a traceback.
"""
import ast
import difflib
import os
import sys
import traceback
from dataclasses import asdict
from types import SimpleNamespace

from model import ModelConfig


class UserError(Exception):
    """The user must fix something (a setting, a path, a file): printed once, without a traceback."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work."""


class ConfigKeyError(UserError, KeyError):
    """An unknown config key."""

    def __str__(self):  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(UserError, TypeError):
    """A config value of the wrong type."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it should be)."""


# Training defaults shared by every stage. Model keys come from ModelConfig; a stage script may
# add keys of its own through `load(argv, extra=...)`.
TRAIN_DEFAULTS = dict(
    # I/O
    out_dir="out/run",
    resume="",               # "": start fresh | "latest" (bare --resume): the newest complete checkpoint in
                             # out_dir, falling back past broken ones | a checkpoint (or run) folder
    overwrite=False,         # a fresh run into an out_dir holding an earlier run moves that run's files to
                             # out_dir/old_<time>/ (nothing is deleted); without it such a run refuses
    force_resume=False,      # resume even where settings changed that break exactness (RESUME_FREE below)
    init_from="",            # start from the weights of a checkpoint folder or a local HF model folder
    ckpt_every=500,          # steps between checkpoints (0: only at the end)
    keep_last=2,             # checkpoints kept on disk
    # data
    data="stdlib",           # "stdlib" | "python" (stdlib + site-packages) | a local file/folder (.txt .md .py .jsonl .parquet) | "hf:<name>"
    text_field="text",
    data_dir="",             # where the tokenized memmaps go ("" -> data/<name>)
    val_fraction=0.01,       # validation share of the corpus: at least val_tokens, at most 10% (data.val_split)
    val_tokens=1 << 20,      # floor of the validation split in tokens (a small corpus still gets a real one)
    max_docs=0,              # 0: all documents
    tokenizer="cl100k_base",
    tokenizer_vocab=0,       # >0: keep only the first N tokens of the BPE (small models)
    # data quality and Fill-in-the-Middle (data.prepare; each changes the prepared folder's name)
    clean=False,             # clean.py's normalisation + quality filters before tokenization
    dedup="none",            # "none" | "exact" (normalised content hash) | "near" (exact + MinHash LSH at Jaccard 0.8)
    fim_rate=0.0,            # share of training documents in FIM layout (fim.py; 0.5 as Bavarian et al. 2022)
    fim_spm_rate=0.5,        # share of those in SPM order (the rest PSM)
    fim_seed=0,              # FIM draws are BLAKE2b(fim_seed, document index): fixed data across training seeds
    fim_fragment=0,          # >0: FIM per fragment of at most this many characters (fim.py), so that a FIM
                             # sequence fits a training window (small.py: 2000 ~ 600 of 1024 tokens); 0: whole documents
    # batch: batch_size sequences per optimizer step, split over data-parallel ranks and
    # gradient-accumulation micro-steps of micro_batch_size sequences each
    batch_size=32,
    micro_batch_size=8,
    seq_len=0,               # 0 -> block_size
    # optimization
    max_steps=1000,
    stop_at=0,               # stop early at this step, e.g. to fit a job time limit (0: run to max_steps)
    optimizer="adamw",
    lr=6e-4,
    min_lr_ratio=0.1,        # final lr = lr * min_lr_ratio
    schedule="cosine",       # cosine | linear | wsd | constant (all after linear warmup)
    warmup_steps=100,
    wsd_decay_frac=0.2,      # WSD: fraction of steps spent decaying at the end
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    grad_clip=1.0,           # 0: no clipping
    # Muon (optimizer="muon"): hidden matrices; embeddings, head, norms, biases stay on AdamW
    muon_lr=0.0,             # 0 -> lr (with muon_scale="rms" AdamW's lr and weight decay carry over)
    muon_momentum=0.95,      # Nesterov momentum
    muon_scale="rms",        # rms: update * 0.2*sqrt(max(rows, cols)) | shape: * sqrt(max(1, rows/cols))
    ns_dtype="bfloat16",     # Newton-Schulz precision: bfloat16 | float32 (exact tests)
    zero1=False,             # ZeRO-1: optimizer state sharded over data-parallel ranks (ddp only)
    # system
    seed=1337,
    device="auto",           # auto | cpu | cuda
    dtype="auto",            # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    compile=False,
    grad_bucket_mb=25.0,     # data-parallel all-reduce bucket size
    grad_reduce_dtype="float32",  # ddp: gradients travel as float32 | bfloat16 (half the bytes, rounded)
    tp=1,                    # tensor-parallel size (Megatron style, innermost: neighbouring GPUs)
    sequence_parallel=False,  # tp > 1: norms, residual and dropout on T/tp positions (tp.py); dense, ddp
    data_parallel="ddp",     # how the world // tp replicas split the batch: ddp (replicated) | fsdp (sharded)
    ep=1,                    # expert-parallel size: experts sharded over ep ranks that see different data (moe.py)
    # LoRA (lora.py): lora_r > 0 freezes the base and trains rank-r adapters
    lora_r=0,
    lora_alpha=16.0,
    lora_dropout=0.0,
    lora_targets="all-linear",  # "all-linear" (attention + MLP) or HF module names: "q_proj,v_proj" (GPT-2: c_attn, ...)
    lora_rslora=False,       # scale alpha / sqrt(r) instead of alpha / r
    lora_base_dtype="float32",  # float32 | bfloat16: the frozen base's storage (bf16 needs bf16 autocast)
    # evaluation and logging
    eval_every=250,
    eval_batches=20,
    log_every=10,
    progress=True,           # tqdm bar on rank 0
    peak_tflops=0.0,         # per-GPU peak for MFU; 0 -> look up the GPU in a table
    tensorboard=False,
    wandb=False,
    wandb_project="ingot",
    sample_tokens=128,       # sample printed at the end (0: none)
    sample_prompt="def ",
    sample_temperature=0.8,
    sample_top_k=50,
)


# Settings a resumed run may change freely: they do not alter the math of the steps to come
# (layout, precision and speed knobs, logging, evaluation, checkpoint cadence, paths). Any other
# changed key (model, data, batch_size, seq_len, optimizer, lr, schedule, max_steps, seed, ...)
# makes the continued run differ from an uninterrupted one: resume refuses it unless
# --force_resume=True. A key unknown here counts as one that matters. checkpoint.resume_changes.
RESUME_FREE = frozenset("""
    out_dir init_from ckpt_every keep_last stop_at data_dir
    device dtype compile grad_bucket_mb grad_reduce_dtype tp sequence_parallel data_parallel ep zero1 micro_batch_size
    ns_dtype grad_checkpoint fp32_residual
    eval_every eval_batches log_every progress peak_tflops tensorboard wandb wandb_project
    sample_tokens sample_prompt sample_temperature sample_top_k
""".split())
RESUME_CONTROL = frozenset({"resume", "overwrite", "force_resume"})  # how to start, not settings
# a bare --key (no =value) for keys that are not bool
BARE_FLAG = {"resume": "latest"}


def defaults(extra=None):
    d = {**asdict(ModelConfig()), **TRAIN_DEFAULTS}
    d.update(extra or {})
    return d


def _unknown(key, valid):
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    return ConfigKeyError(f"unknown config key '{key}'.{hint} (valid keys are listed in config.py and "
                          f"model.py's ModelConfig)")


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
    """Execute a config file (plain Python) and keep its public assignments."""
    if not os.path.isfile(path):
        raise MissingFileError(f"config file '{path}' not found (configs live in configs/, e.g. configs/tiny.py)")
    scope = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    out = {}
    for key, value in scope.items():
        if key.startswith("_") or callable(value) or type(value).__name__ == "module":
            continue
        if key not in d:
            raise _unknown(key, list(d))
        out[key] = _check_type(key, value, d[key])
    return out


def load(argv, extra=None, world=None):
    """argv: [config_file.py] [--key=value ...] -> validated flat namespace."""
    d = defaults(extra)
    values = dict(d)
    args = list(argv)
    if args and not args[0].startswith("--"):
        values.update(read_file(args.pop(0), d))
    for a in args:
        k, v = parse_override(a, d)
        values[k] = v
    cfg = SimpleNamespace(**values)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world is None else world)
    return cfg


def validate(cfg, world=1):
    """Fail early, with a message that says what to change."""
    try:
        ModelConfig.from_cfg(cfg)  # model checks (heads divide width, known activation, ...)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e

    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
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
    need(cfg.dedup in ("none", "exact", "near"), f"dedup='{cfg.dedup}' must be none, exact or near")
    need(0 <= cfg.fim_rate <= 1 and 0 <= cfg.fim_spm_rate <= 1,
         f"fim_rate={cfg.fim_rate} and fim_spm_rate={cfg.fim_spm_rate} must be in [0, 1]")
    need(cfg.fim_seed >= 0, f"fim_seed={cfg.fim_seed} must be >= 0")
    need(isinstance(cfg.fim_fragment, int) and cfg.fim_fragment >= 0,
         f"fim_fragment={cfg.fim_fragment} must be an integer >= 0 (characters per FIM fragment; 0: whole documents)")
    need(cfg.device in ("auto", "cpu", "cuda"), f"device='{cfg.device}' must be auto, cpu or cuda")
    need(cfg.dtype in ("auto", "float32", "bfloat16"), f"dtype='{cfg.dtype}' must be auto, float32 or bfloat16")
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
    need(world % (cfg.tp * cfg.ep) == 0, f"world size {world} is not divisible by tp*ep={cfg.tp * cfg.ep}")
    dp = world // (cfg.tp * cfg.ep) * cfg.ep  # data-parallel ranks: EP ranks see different data too
    need(cfg.micro_batch_size > 0 and cfg.batch_size > 0, "batch_size and micro_batch_size must be positive")
    need(cfg.batch_size % (cfg.micro_batch_size * dp) == 0,
         f"batch_size={cfg.batch_size} must be divisible by micro_batch_size*data_parallel="
         f"{cfg.micro_batch_size}*{dp}={cfg.micro_batch_size * dp}: change batch_size or micro_batch_size")
    need(0 <= cfg.seq_len <= cfg.block_size, f"seq_len={cfg.seq_len} must be in [0, block_size={cfg.block_size}] (0 means block_size)")
    need(0 <= cfg.val_fraction < 1, f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    need(cfg.keep_last >= 1, f"keep_last={cfg.keep_last} must be >= 1")
    need(cfg.ckpt_every >= 0 and cfg.eval_every >= 0 and cfg.log_every > 0,
         "ckpt_every and eval_every must be >= 0 and log_every > 0")
    need(cfg.tokenizer_vocab == 0 or cfg.tokenizer_vocab >= 257,
         f"tokenizer_vocab={cfg.tokenizer_vocab} must be 0 (full BPE) or >= 257 (256 bytes + EOS)")
    need(cfg.peak_tflops >= 0, f"peak_tflops={cfg.peak_tflops} must be >= 0")
    need(cfg.lora_r >= 0, f"lora_r={cfg.lora_r} must be >= 0 (0: no LoRA)")
    need(cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1,
         f"lora_alpha={cfg.lora_alpha} must be > 0 and lora_dropout={cfg.lora_dropout} in [0, 1)")
    need(cfg.lora_base_dtype in ("float32", "bfloat16"), f"lora_base_dtype='{cfg.lora_base_dtype}' must be float32 or bfloat16")
    need(not cfg.lora_r or (cfg.optimizer == "adamw" and not cfg.zero1),
         "LoRA trains with AdamW, without zero1 (Muon is for full hidden matrices; the adapters' state is small): "
         "set optimizer='adamw', zero1=False")
    need(cfg.grad_bucket_mb > 0, f"grad_bucket_mb={cfg.grad_bucket_mb} must be positive")
    # found here, not after training: numpy's generators take seeds in [0, 2**32)
    need(0 <= cfg.seed < 2**32, f"seed={cfg.seed} must be in [0, 2**32)")
    need(cfg.val_tokens >= 0, f"val_tokens={cfg.val_tokens} must be >= 0")
    need(cfg.max_docs >= 0, f"max_docs={cfg.max_docs} must be >= 0 (0: all documents)")
    need(cfg.eval_batches >= 0, f"eval_batches={cfg.eval_batches} must be >= 0 (0: the whole validation split)")
    need(cfg.sample_tokens >= 0, f"sample_tokens={cfg.sample_tokens} must be >= 0 (0: no sample)")
    need(cfg.sample_temperature >= 0, f"sample_temperature={cfg.sample_temperature} must be >= 0 (0: greedy)")
    need(cfg.sample_top_k >= 0, f"sample_top_k={cfg.sample_top_k} must be >= 0 (0: no top-k filter)")


def show(cfg):
    width = max(len(k) for k in vars(cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in sorted(vars(cfg).items()))


def run(main, argv):
    """Run a stage script's main(argv) so that a mistake the user must fix reads as one message.

    A UserError prints `error: <message>` once and exits with status 2, without a traceback: rank 0
    under torchrun (every rank meets the same error; the others leave quietly with status 0, so
    torchrun's own summary that follows names one failed process); `--debug` anywhere
    on the command line shows the traceback instead. Every other exception is a bug and keeps its
    traceback on every rank that hits it.
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
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves: parallel.Interrupt)
        if debug:
            traceback.print_exc()
        sys.exit(130)
