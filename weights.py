"""A run's model family and initial weights: init_from, and the model a stage builds.

    fam = weights.family(cfg)              # the decoder, or the family objective / a variant key asks for
    started = weights.configure(cfg)       # init_from's model keys, tokenizer (and family) become cfg's
    started, tok, template = weights.configure_chat(cfg, grid.world)   # SFT, DPO, GRPO: and the chat template
    raw = weights.build_model(cfg, grid)   # the full model on the device, seeded; init_from's weights come next
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    ref = weights.build_net(cfg, grid, load, frozen=True)  # both in one call: a frozen reference (DPO, GRPO)
    weights.load_model("out/tiny/step_000300", model)     # sample.py, eval.py, plots: a plain model

Family is the one interface of a model family or objective: what it builds, its batches and loss
(pretraining, SFT), FLOPs, what it generates, its checks, HF folders and its own keys. Its methods
are the decoder's (model.Transformer); encoders/ implement the others (bert.py: objective "mlm",
t5.py: "span", prefix.py: prefix tuning, an SFT variant of the decoder). The stage scripts name
none of them: family(cfg) finds one through FAMILIES / VARIANTS, modules imported only when a run
asks for one, and config.load's plugins hook (objective_keys, variant_keys) adds its keys.
An HF folder is read by hf.py (each TP rank reads only its rows / columns); our checkpoints give
full tensors that tp.local_tensor cuts. A LoRA run's adapters are merged into their base; a
vocabulary smaller than the run's (chat tokens just added) grows, the new rows the mean of the old.
Under LoRA those new rows train too (lora_train_tokens: lora.train_tokens in loader; base_vocab).
"""
import importlib
import json
import os
from dataclasses import fields
from types import SimpleNamespace

import torch

import chat
import checkpoint
import config
import generate
import hf
import lora
import parallel
import rope
from config import need
from memory import materialize
from model import ModelConfig, Transformer
from parallelism import tp
from tools import scoring

# The families a run may ask for: modules whose FAMILY implements Family, imported only then (family()).
FAMILIES = {"mlm": "encoders.bert", "span": "encoders.t5"}  # objective (pretraining's; init_from's model sets it)
VARIANTS = {"prefix_tokens": "encoders.prefix"}  # a decoder variant (SFT) -> its module, picked by this key > 0
HF_TYPES = {"bert": "mlm", "t5": "span"}  # an HF folder's model_type -> its objective


class Family:
    """A model family or objective, as the stage scripts use it. These methods are the decoder's
    (model.Transformer: next-token prediction, chat rows); a family in encoders/ overrides what differs."""
    name = "decoder"              # how a message names it
    chosen_by = "objective='lm'"  # how a run picks it
    keys = {}                     # its own config keys (its module's *_DEFAULTS), added by config.load's plugins hook
    Model = Transformer           # the module it builds, from model_config(cfg)
    no_sample = ""                # why sample.py cannot continue a prompt with it ("": it can)
    bits_per_byte = True          # pretraining's validation also reports bits per byte

    # ------------------------------------------------------------------------ what it builds, init_from
    def model_config(self, cfg):
        """cfg's model config; one that cannot work, or a layout or key the family refuses: ConfigError (one line)."""
        try:
            return ModelConfig.from_cfg(cfg)
        except (ValueError, TypeError) as e:
            raise config.ConfigError(str(e)) from e

    def adapter_key(self, name):
        """Whether a saved name beside the model's own is a PEFT adapter's (LoRA's) that a checkpoint may hold."""
        return lora.is_adapter(name)

    def reference(self, mcfg):
        """checkpoint.read_weights' keywords for a model of config mcfg (module function reference())."""
        return reference(mcfg, self.Model, self.adapter_key)

    def configure(self, cfg):
        """configure() for this family's init_from -> the line saying so. An HF folder: its config.json's
        model keys, its tokenizer. Our checkpoint or run folder (init_from then names its newest
        checkpoint): its model keys, tokenizer, tokenizer_vocab and tokenizer_fim (a truncated vocabulary's
        ids depend on it). block_size and rope_scaling: context()'s (a block_size beyond the model's
        positions is the user's, said); the line names any other of these keys the user gave that
        init_from replaced."""
        is_hf = hf.is_hf_folder(cfg.init_from)
        if is_hf:
            try:
                m = vars(hf.config_from_hf(hf.read_config(cfg.init_from)))
            except ValueError as e:
                raise config.ConfigError(f"init_from={cfg.init_from}: {e}") from e
            keys, tok = hf.MODEL_KEYS, dict(tokenizer=cfg.init_from, tokenizer_vocab=0)
        else:
            cfg.init_from, m = init_checkpoint(cfg.init_from)
            m = {**vars(ModelConfig()), **m}  # a model key newer than the checkpoint: its default (off)
            keys = [f.name for f in fields(ModelConfig)
                    if f.name not in ("dropout", "grad_checkpoint", "fp32_residual", "fp8_head")]
            tok = {k: m[k] for k in ("tokenizer", "tokenizer_vocab")}  # its FIM sentinels (older checkpoints: fim_rate)
            tok["tokenizer_fim"] = m.get("tokenizer_fim", m.get("fim_rate", 0) > 0)
        m, longer = context(cfg, m, cut=is_hf or m["pos_emb"] == "rope")
        taken = [(k, m[k]) for k in keys] + list(tok.items())
        replaced = [f"{k}={v!r} (not {getattr(cfg, k)!r} as given)" for k, v in taken if k in getattr(cfg, "given", ())
                    and k not in ("block_size", "rope_scaling") and getattr(cfg, k) != v]
        for k, v in taken:
            setattr(cfg, k, v)
        if cfg.seq_len > cfg.block_size:
            raise config.ConfigError(f"seq_len={cfg.seq_len} > block_size={cfg.block_size} of {cfg.init_from}")
        line = f"model and tokenizer of {'the HF folder' if is_hf else 'checkpoint'} {cfg.init_from}"
        return line + (f"; note: init_from's {', '.join(replaced)}: drop those keys, or start without init_from"
                       if replaced else "") + (f"\n{longer}" if longer else "")

    def loader(self, cfg, grid):
        """parallelize's `load` callback for cfg.init_from (None without one): an HF folder (each TP rank
        reads its rows / columns) or our checkpoint (full tensors cut to this TP rank; a LoRA run's merged).
        A smaller vocabulary (chat specials just added) grows (grow_vocab), said once; under LoRA
        (lora_train_tokens) the new tokens' rows then train (lora.train_tokens; not in a frozen reference)."""
        if not cfg.init_from:
            return None
        src, is_hf, old = cfg.init_from, hf.is_hf_folder(cfg.init_from), base_vocab(cfg)
        new = range(old, cfg.vocab_size) if cfg.lora_r and cfg.lora_train_tokens else range(0)
        if new and cfg.pp > 1 and cfg.tie_embeddings:
            raise config.ConfigError("lora_train_tokens=True: the new tokens' rows of tied embeddings cannot train "
                                     "across pipeline stages (pp > 1): set --lora_train_tokens=False, or pp=1")
        if old < cfg.vocab_size and grid.is_main:
            print(f"init_from: vocabulary grown from {old} to {cfg.vocab_size} tokens (new rows: the mean of the old"
                  + (f"; LoRA trains the rows of tokens {old}..{cfg.vocab_size - 1} too)" if new else ")"))

        def load(model):
            if is_hf:
                params, base = dict(model.named_parameters()), tp.hf_shard_fn(model, grid)

                def shard_fn(name, part):  # vocabulary rows: read whole, grown, then cut like the rest
                    if name in ("tok_emb.weight", "head.weight") and old < cfg.vocab_size:
                        return tp.local_tensor(params[name], grow_vocab(part[:], old, cfg.vocab_size), grid)
                    return base(name, part)
                hf.load_weights(src, model, shard_fn)
            else:
                saved = SimpleNamespace(**init_checkpoint(src)[1])  # (the family that saved it: its adapters)
                weights = checkpoint.read_weights(src, **family(saved).reference(ModelConfig.from_cfg(saved)))
                parallel.load_full_state_dict(model, grid, fit_weights(weights, vars(saved), model.cfg))
            if new and any(p.requires_grad for p in model.parameters()):  # (a frozen reference keeps the base's rows)
                lora.train_tokens(model, new, grid)  # on the TP cut, before lora.apply and FSDP
        return load

    # ------------------------------------------------------------------------ pretraining (pretrain.py)
    def pretrain_check(self, cfg, tok):
        """Pretraining's checks of the family, before any work: its keys, the vocabulary it needs, its model."""
        self.model_config(cfg)

    def vocabulary(self, cfg, tok):
        """A fresh model's vocab_size: the tokenizer's (padded inside the model)."""
        return tok.n_vocab

    def read_length(self, cfg):
        """Tokens of the corpus one row reads."""
        return cfg.seq_len or cfg.block_size

    def read_grid(self, grid):
        """The grid the loader reads for: its device is where the windows go (the step's batches())."""
        return grid

    def batches(self, loader, accum, step, cfg, tok, grid):
        """One step's micro-batches [(x, y, forward keywords)] for net.train_step: the loader's windows."""
        return [(*loader.next(), {}) for _ in range(accum)]

    def loss_fn(self, micro, grid):
        """net.train_step's loss_fn over batches()' micro-batches: the mean over the global batch (each
        micro-step's mean loss / their count); its tallies add up to the step's loss."""
        accum = len(micro)
        return lambda i, loss: (loss / accum, loss.detach() / accum)

    def held_out(self, net, x, y, j, cfg, tok, grid, nbytes):
        """Validation window batch j (x, y) -> [mean NLL, 1, NLL of targets with bytes, their bytes]
        (scoring.nll_terms), summed over batches and ranks: the loss and bits per byte."""
        return scoring.nll_terms(net(x, y, reduction="none").float(), y, nbytes)

    def flops_per_token(self, model, cfg):
        """Training FLOPs per corpus token read (model: the full one, before it is cut)."""
        return model.flops_per_token(self.read_length(cfg))

    # ------------------------------------------------------------------------ supervised fine-tuning (sft.py)
    def sft_check(self, cfg, grid):
        """SFT's checks of the family: its model config; LoRA on a meta copy (unknown targets, nothing
        adapted (MoE), bf16 without autocast)."""
        mcfg = self.model_config(cfg)
        if cfg.lora_r:
            with torch.device("meta"):
                model = Transformer(mcfg)
            try:
                lora.apply(model, cfg, grid)
            except ValueError as e:
                raise config.ConfigError(f"LoRA: {e}") from e

    def chat_setup(self, cfg):
        """(tokenizer, chat template or None) of a chat stage: chat.setup's."""
        return chat.setup(cfg)

    def positions(self, cfg):
        """Positions a row (prompt and answer) may take."""
        return cfg.block_size

    def row_length(self, cfg):
        """T of SFT's rows."""
        return min(cfg.seq_len or cfg.block_size, self.positions(cfg))

    def rows(self, convs, tok, template, T, pack):
        """Conversations -> (rows, Counter of dropped examples): chat.pack's rows of T + 1 tokens (pack
        False: one conversation per row, padded), a loss mask over each answer and its end of turn."""
        return chat.pack([chat.encode(tok, template, c) for c in convs], T, one_per_row=not pack)

    def describe(self, rows, T, cfg):
        """(tokens trained on, a phrase for the rows) of rows()' training rows."""
        n_loss, n_real = sum(int(r.mask[1:].sum()) for r in rows), sum(int((r.seg >= 0).sum()) for r in rows)
        return n_loss, (f"{len(rows):,} rows of {T + 1} tokens ({'packed' if cfg.pack else 'padded'}, "
                        f"{n_real / (len(rows) * (T + 1)):.0%} filled)")

    def tuning(self, cfg):
        """What trains, in a few words."""
        return f"LoRA r={cfg.lora_r} on {cfg.lora_targets}" if cfg.lora_r else "full fine-tuning"

    def sft_loader(self, rows, cfg, grid):
        """The training rows' loader for this data rank: next() -> (x, y, forward keywords) (sft_batch's)."""
        return ChatRows(rows, cfg.micro_batch_size, grid.data_rank, grid.data_world, cfg.seed, grid.device)

    def sft_batch(self, rows, device="cpu"):
        """Rows -> (x, y, forward keywords): chat.batch's positions and attention mask, the NLL summed."""
        x, y, pos, mask = chat.batch(rows, device)
        return x, y, dict(reduction="sum", pos=pos, attn_mask=mask)

    def answers(self, raw, tok, template, prompts, cfg):
        """Greedy answers (token lists, the end of turn cut) of the plain model raw to chat prompts."""
        ids = [chat.encode(tok, template, p, add_generation_prompt=True)[0] for p in prompts]
        new = min(cfg.eval_tokens, self.positions(cfg) - max(map(len, ids)))
        need(new >= 1, f"a held-out prompt has {max(map(len, ids))} tokens: block_size {cfg.block_size} leaves no "
             f"room for an answer")
        # prompts decoded together: at most a training micro-step's tokens (long prompts: fewer rows of cache)
        rows = max(1, cfg.micro_batch_size * cfg.block_size // (max(map(len, ids)) + new))
        return [a for i in range(0, len(ids), rows) for a in self.decode(raw, tok, ids[i:i + rows], new)]

    def decode(self, raw, tok, ids, new):
        """answers()' greedy decoding of token prompts: generate.decode's static cache, only ids tok decodes,
        until its end of turn (cut)."""
        stop_id = tok.eot_id
        r = generate.decode(raw, ids, new, vocab=tok, temperature=0.0, stop_tokens=[stop_id], pad_id=stop_id)
        return [[t for t in row[:n] if t != stop_id] for row, n in zip(r.tokens[:, r.prompt_len:].tolist(),
                                                                       r.lengths.tolist())]

    def peft(self, raw, full, cfg):
        """lifecycle.save's `extra` for a checkpoint's full weights: a writer of the PEFT adapter (LoRA's), or None."""
        adapters = {k: v for k, v in full.items() if lora.is_adapter(k)}
        return (lambda d: lora.save_peft(d, adapters, cfg)) if adapters else None

    def export_hf(self, full, cfg, tok, template, folder):
        """export_hf=<folder>: full weights (LoRA merged) as an HF folder -> the line that says so."""
        model = self.Model(self.model_config(cfg))
        model.load_state_dict(full)
        return self.write_hf(model, folder, tok, template)

    def write_hf(self, model, folder, tok, template):
        tok.chat_template = template.source  # tokenizer.save_tokenizer writes it into tokenizer_config.json
        hf.export_hf(model, folder, tokenizer=tok)
        return f"HF folder written to {folder} (transformers' AutoModelForCausalLM and chat template read it)"


class ChatRows(chat.ChatLoader):
    """chat.ChatLoader whose batches are net.train_step's (x, y, forward keywords) (Family.sft_batch's)."""

    def next(self):
        x, y, pos, mask = super().next()
        return x, y, dict(reduction="sum", pos=pos, attn_mask=mask)


DECODER = Family()


def family(cfg):
    """The Family cfg asks for: objective's (FAMILIES; "lm" or none: the decoder), or a decoder variant
    whose key (VARIANTS) is > 0; its module imported only now. An unknown objective, or a variant of
    another family: ConfigError (one line)."""
    objective = getattr(cfg, "objective", "lm")
    need(objective == "lm" or objective in FAMILIES,
         f"objective={objective!r} must be one of {', '.join(['lm', *FAMILIES])}")
    fam = DECODER if objective == "lm" else importlib.import_module(FAMILIES[objective]).FAMILY
    for key, module in VARIANTS.items():
        if getattr(cfg, key, 0):
            variant = importlib.import_module(module).FAMILY
            need(fam is DECODER, f"{variant.name} ({key}={getattr(cfg, key)}) tunes a decoder: not a {fam.name} "
                 f"({fam.chosen_by})")
            fam = variant
    return fam


def objective_keys(values, unknown):
    """config.load's plugins hook for a stage that selects by objective (pretraining): (the keys of the
    family values' objective picks, its model check); values None (--help): every family's keys. unknown:
    the keys given that the stage lacks; one another family owns is refused, naming where it belongs."""
    if values is None:
        return keys_of(FAMILIES.values()), None
    fam = family(SimpleNamespace(objective=values.get("objective", "lm")))
    refuse_others(unknown - set(fam.keys), FAMILIES.values())
    return fam.keys, fam.model_config


def variant_keys(values, unknown):
    """config.load's plugins hook for SFT: the keys of each decoder variant whose key (VARIANTS) was
    given, as objective_keys (the decoder's model check: None)."""
    if values is None:
        return keys_of(VARIANTS.values()), None
    keys = keys_of(m for k, m in VARIANTS.items() if k in unknown)
    refuse_others(unknown - set(keys), VARIANTS.values())
    return keys, None


def keys_of(modules):
    """The keys and defaults of the families of these modules (imported)."""
    return {k: v for m in modules for k, v in importlib.import_module(m).FAMILY.keys.items()}


def refuse_others(keys, modules):
    """ConfigError naming the family (one of modules') that owns one of `keys`: keys a run gave without
    choosing their family. The modules are imported only when such keys were given (the run stops, or
    config.load names the keys nobody owns)."""
    families = [importlib.import_module(m).FAMILY for m in modules] if keys else []
    for k in sorted(keys):
        owners = [f for f in families if k in f.keys]
        need(not owners, f"{k} is a key of {' / '.join(f.name for f in owners)} "
             f"({' or '.join(f.chosen_by for f in owners)}), which this run did not choose: choose it, or drop {k}")


def model_config(cfg):
    """The model config cfg describes (its family's, family(cfg).model_config)."""
    return family(cfg).model_config(cfg)


def reference(mcfg, Model=Transformer, keep=lora.is_adapter):
    """checkpoint.read_weights' / load's keywords for a model of config mcfg: the one-process model's
    state dict (Model built on the meta device: names, full shapes, tied names one tensor), mcfg, and
    keep(name): a saved name beyond them that is a PEFT adapter's."""
    with torch.device("meta"):
        expected = Model(mcfg).state_dict(keep_vars=True)
    return dict(expected=expected, mcfg=mcfg, keep=keep)


def init_checkpoint(path):
    """init_from: one of our checkpoint folders, or a run folder (its newest) -> (its path, its config dict)."""
    ckpt = path if os.path.isfile(os.path.join(path, "model.safetensors")) else checkpoint.latest(path)
    if ckpt is None:
        what = "no checkpoint in it" if os.path.isdir(path) else "no such folder"
        raise config.MissingFileError(f"init_from={path}: {what} (name a checkpoint, a run folder or a local HF model "
                                      "folder)")
    return ckpt, hf.read_config(ckpt)


def context(cfg, m, cut=True):
    """init_from's model config m (a dict) -> (m with the run's block_size and rope_scaling, a line to say
    or ""). block_size not given: the model's positions M (cut: at most cfg's default). Given: the user's
    N, never cut: beyond M a learned position table refuses (ConfigError), RoPE runs at N with the model's
    or the given rope_scaling (rope.resolve: a type's name gets factor = N / the model's original
    positions), or unscaled, and ALiBi runs; the line says so. A given rope_scaling needs RoPE."""
    M, given, scaling = m["block_size"], getattr(cfg, "given", ()), m.get("rope_scaling") or {}
    N = cfg.block_size if "block_size" in given else min(cfg.block_size, M) if cut else M
    need(m["pos_emb"] != "learned" or N <= M, f"block_size={N} > the {M} positions of init_from={cfg.init_from}'s "
         f"learned position table (GPT-2 style: it cannot grow): set block_size <= {M}")
    if "rope_scaling" in given:
        need(m["pos_emb"] == "rope", f"rope_scaling={cfg.rope_scaling!r} scales RoPE: init_from={cfg.init_from} "
             f"has pos_emb={m['pos_emb']!r}: drop rope_scaling")
        try:
            scaling = rope.resolve(cfg.rope_scaling, N, M, scaling)
        except ValueError as e:
            raise config.ConfigError(str(e)) from e
    m = dict(m, block_size=N, rope_scaling=scaling)
    if m["pos_emb"] == "learned" or not (N > M or scaling and "rope_scaling" in given):
        return m, ""
    if scaling:
        return m, f"training at {N} positions, the model's {M}, rope_scaling={scaling['rope_type']} " \
                  f"(factor {scaling['factor']:g})"
    return m, (f"training at {N} positions, the model's {M}: positions {M}..{N - 1} were never trained " + (
        "(ALiBi's biases extrapolate)" if m["pos_emb"] == "alibi" else
        "and RoPE is not scaled (--rope_scaling=yarn, or linear, dynamic, llama3, scales it)"))


def configure(cfg):
    """init_from's model and tokenizer become cfg's (no need to repeat the model shape); returns a line
    saying so ("" without init_from): its family's configure (Family.configure). Its objective becomes
    cfg's (SFT: a T5 trains sequence to sequence; pretraining: the family's keys join cfg with their
    defaults); a different objective the user gave is refused. loader(cfg, grid) then loads the weights."""
    if not cfg.init_from:
        scaling = getattr(cfg, "rope_scaling", {})
        need(not isinstance(scaling, str), f"rope_scaling={scaling!r} scales init_from's positions: without "
             f"init_from give its whole dict (factor, original_max_position_embeddings, ...)")
        return ""
    objective = init_objective(cfg.init_from)
    if objective != getattr(cfg, "objective", "lm"):
        if "objective" in getattr(cfg, "given", ()):
            raise config.ConfigError(f"init_from={cfg.init_from} holds a model of objective={objective!r}, this run "
                                     f"has objective={cfg.objective!r}: set objective={objective!r}")
        selects = hasattr(cfg, "objective")  # (a stage that selects by objective reads its family's keys)
        cfg.objective = objective
        for k, v in family(cfg).keys.items() if selects else ():
            setattr(cfg, k, getattr(cfg, k, v))
    return family(cfg).configure(cfg)


def base_vocab(cfg):
    """init_from's vocabulary size, before this run's chat tokens grew it (None without init_from)."""
    if not cfg.init_from:
        return None
    src = cfg.init_from
    return hf.read_config(src)["vocab_size"] if hf.is_hf_folder(src) else init_checkpoint(src)[1]["vocab_size"]


def init_objective(path):
    """The objective init_from's model was built for: an HF folder's by its model_type (HF_TYPES), our
    checkpoint's by its config; "lm" for the rest."""
    if hf.is_hf_folder(path):
        return HF_TYPES.get(hf.read_config(path).get("model_type"), "lm")
    return init_checkpoint(path)[1].get("objective", "lm")


def folder_family(path):
    """The Family of a model folder (an HF folder, or one of our checkpoints): sample.py's question."""
    saved = hf.read_config(path)
    return family(SimpleNamespace(**({"objective": init_objective(path)} if hf.is_hf_folder(path) else saved)))


def configure_chat(cfg, world):
    """A chat stage's configure step -> (configure's line, tokenizer, template): init_from's model keys and
    tokenizer (configure), the family's chat setup (chat.setup: the template's special tokens; a T5's
    plain tokenizer, no template), vocab_size the tokenizer's without init_from, cfg validated again (its
    model keys just changed)."""
    started = configure(cfg) or "no init_from: random initial weights"
    fam = family(cfg)
    tok, template = fam.chat_setup(cfg)
    if not cfg.init_from:
        cfg.vocab_size = tok.n_vocab
    config.validate(cfg, world, fam.model_config)
    return started, tok, template


def build_model(cfg, grid, frozen=False):
    """The full model of cfg (its family's) on grid.device, before parallelize lays it out; the same on
    every rank. Weights trained in fp32 (pretraining, full fine-tuning, a LoRA base kept in fp32): built
    on the CPU in fp32 from cfg.seed, then moved (the same weights on any machine). A LoRA base in bf16 /
    NF4, or any LoRA run from init_from: built straight into the frozen base's storage dtype on the
    device (materialize.build, no fp32 copy anywhere; init_from's loader fills every tensor, else the
    initial weights are drawn there), QLoRA's block linears on the host until qlora.quantize takes them
    to the GPU in 4 bits. frozen: no gradients (a reference model; never QLoRA)."""
    torch.manual_seed(cfg.seed)
    fam = family(cfg)
    mcfg = fam.model_config(cfg)
    dtype = materialize.storage_dtype(cfg, parallel.amp_dtype(cfg, grid.device)) if cfg.lora_r else torch.float32
    if cfg.lora_r and (cfg.init_from or dtype != torch.float32):  # (LoRA adapts the decoder only: model_config)
        host = cfg.lora_base_dtype == "nf4" and grid.device.type == "cuda" and not frozen
        model = materialize.build(mcfg, grid.device, dtype, init=not cfg.init_from,
                                  linear_device="cpu" if host else None)
    else:
        model = fam.Model(mcfg).to(grid.device)
    return model.requires_grad_(not frozen)


def build_net(cfg, grid, load=None, frozen=False):
    """build_model, laid out by parallel.parallelize with load's weights (loader's) -> parallel.Net. frozen:
    a reference copy (no gradients, no optimizer; without init_from it equals the policy's start)."""
    return parallel.parallelize(build_model(cfg, grid, frozen=frozen), grid, cfg, load=load, optimizer=not frozen)


def loader(cfg, grid):
    """parallelize's `load` callback: the family's (Family.loader; None: no init_from, nothing to do)."""
    return family(cfg).loader(cfg, grid)


def grow_vocab(t, n_old, n_new):
    """Rows n_old..n_new-1 (tokens just added) = the mean of the n_old real rows: an average token, not noise."""
    t = t.clone()
    t[n_old:n_new] = t[:n_old].float().mean(0).to(t.dtype)
    return t


def fit_weights(weights, saved, mcfg):
    """A checkpoint's full weights (`saved`: its config dict) -> model config mcfg's: LoRA adapters
    merged into their base, vocabulary grown (grow_vocab), a learned position table cut to block_size."""
    if any(lora.is_adapter(k) for k in weights):
        weights = lora.merge_weights(weights, SimpleNamespace(**saved))
    out, n = dict(weights), saved["vocab_size"]
    if "pos_emb.weight" in out:  # a learned position table: the first block_size rows
        out["pos_emb.weight"] = out["pos_emb.weight"][:mcfg.block_size]
    for k in ("tok_emb.weight", "head.weight") if n < mcfg.vocab_size else ():
        grown = torch.cat([out[k][:n], out[k].new_zeros(mcfg.padded_vocab - n, mcfg.n_embd)])
        out[k] = grow_vocab(grown, n, mcfg.vocab_size)
    return out


def load_model(path, model, fam=DECODER):
    """Load a checkpoint's weights into a plain (unsharded) model of family fam (a LoRA run's: adapters merged)."""
    sd = checkpoint.read_weights(path, **reference(model.cfg, type(model), fam.adapter_key))
    if any(lora.is_adapter(k) for k in sd):
        with open(os.path.join(path, "config.json")) as f:
            sd = fit_weights(sd, json.load(f), model.cfg)
    with torch.no_grad():
        for k, t in model.state_dict().items():
            t.copy_(sd[k])
    return sd
