"""RoPE scaling (rope.py) against transformers, and a block_size beyond init_from's positions (weights.context).

Proves:
- for linear, dynamic, yarn (transformers' defaults; and beta_fast / beta_slow / truncate / mscale set) and
  llama3: our inverse frequencies and attention factor equal transformers' ROPE_INIT_FUNCTIONS bit for bit
  (dynamic: at the input's length, as HF's forward computes them), and our logits equal LlamaForCausalLM's on a
  tiny folder made with that rope_scaling, at 48 tokens, three times its 16 original positions (fp32, <= 1e-4;
  the scaling moves them by more than 100x that); export_hf's folder gives them again in transformers (and in
  ours), with max_position_embeddings and rope_scaling as HF reads them;
- --rope_scaling=yarn on the command line with an HF folder of 16 positions and --block_size=48: the run's
  model is transformers' with {"rope_type": "yarn", "factor": 3, "original_max_position_embeddings": 16}
  (its defaults for the rest) and max_position_embeddings 48, logits equal; the line says so; HF's dict as
  JSON on the command line is taken as given (its original positions the folder's);
- sft.py (a subprocess) from one of our checkpoints trained at 32 positions with --block_size=128 is never
  silent: with --rope_scaling=yarn it trains at 128 and says "training at 128 positions, the model's 32,
  rope_scaling=yarn (factor 4)" once, its rows are 129 tokens, its checkpoint keeps block_size 128 and the
  scaling, and its export_hf folder loads in transformers with our checkpoint's logits at 128 tokens; without
  rope_scaling it says which positions were never trained and names --rope_scaling; a learned position table
  (our checkpoint, an HF GPT-2 folder) refuses in one line; a smaller block_size takes its first rows.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import checkpoint  # noqa: E402
import config  # noqa: E402
import hf  # noqa: E402
import parallel  # noqa: E402
import rope  # noqa: E402
import sft  # noqa: E402
import weights  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
V, T, OLD = 97, 48, 16  # vocabulary, the length compared, the original positions
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.1, rope_theta=500.0, bos_token_id=None, eos_token_id=None)
SCALINGS = {  # name -> (rope_scaling, max_position_embeddings) as HF folders hold them
    "linear": (dict(rope_type="linear", factor=4.0), 64),
    "dynamic": (dict(rope_type="dynamic", factor=4.0), OLD),  # (HF's dynamic: max_position_embeddings is the original)
    "yarn": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=OLD), 64),
    "yarn_set": (dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=OLD, beta_fast=8, beta_slow=2,
                      truncate=False, mscale=1.0, mscale_all_dim=0.5), T),
    "llama3": (dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=OLD), 64),
}
TINY = dict(tokenizer="cl100k_base", tokenizer_vocab=512, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
            block_size=32)
LEARNED = dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True)
SFT = ["--n_train=16", "--n_eval=0", "--batch_size=2", "--micro_batch_size=2", "--max_steps=1", "--device=cpu",
       "--progress=False"]


def folder(path, scaling, max_positions, **over):
    """A tiny random LlamaForCausalLM with that rope_scaling, saved into path -> (model, path)."""
    torch.manual_seed(0)
    kw = {**LLAMA, "max_position_embeddings": max_positions, "rope_scaling": dict(scaling) if scaling else None, **over}
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(path))
    return ref, str(path)


def ids(seed=1, length=T):
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(seed))


def assert_close(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_are_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling, positions = SCALINGS[name]
    hf_cfg = transformers.LlamaConfig(**{**LLAMA, "max_position_embeddings": positions, "rope_scaling": dict(scaling)})
    seq = dict(seq_len=torch.tensor(T)) if name == "dynamic" else {}  # (HF's forward: the input's length, a tensor)
    theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, None, **seq)
    ours, our_factor = rope.inv_freq(16, 500.0, rope.from_hf(dict(scaling), positions), T)
    assert torch.equal(ours, theirs) and our_factor == their_factor


@pytest.mark.parametrize("name", list(SCALINGS))
@torch.no_grad()
def test_logits_import_export(name, tmp_path):
    scaling, positions = SCALINGS[name]
    ref, path = folder(tmp_path / "hf", scaling, positions)
    ours, x = hf.load_hf(path, block_size=T), ids()
    assert ours.cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    want = ref(x).logits
    assert_close(ours(x), want)
    plain = Transformer(ModelConfig(**{**vars(ours.cfg), "rope_scaling": {}}))  # the scaling is exercised
    plain.load_state_dict(ours.state_dict())
    assert (plain.eval()(x) - want).abs().max() > 100 * 1e-4
    hf.export_hf(ours, str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["max_position_embeddings"] == (OLD if name == "dynamic" else T)
    assert saved["rope_scaling"]["rope_type"] == saved["rope_parameters"]["rope_type"] == scaling["rope_type"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert_close(back(x).logits, want)
    assert_close(hf.load_hf(str(tmp_path / "out"), block_size=T)(x), want)


@torch.no_grad()
def test_rope_scaling_by_name_from_an_hf_folder(tmp_path):
    """--rope_scaling=yarn --block_size=48 on a folder of 16 positions: transformers' yarn, factor 3."""
    _, path = folder(tmp_path / "hf", None, OLD)
    cfg = config.load([f"--init_from={path}", f"--block_size={T}", "--rope_scaling=yarn"], extra=sft.EXTRA, world=1)
    line = weights.configure(cfg)
    assert f"training at {T} positions, the model's {OLD}, rope_scaling=yarn (factor 3)" in line.splitlines()
    assert cfg.block_size == T and cfg.rope_scaling == dict(rope_type="yarn", factor=3.0,
                                                            original_max_position_embeddings=OLD)
    ours = Transformer(ModelConfig.from_cfg(cfg))
    weights.loader(cfg, parallel.init(cfg))(ours)
    theirs = transformers.LlamaForCausalLM.from_pretrained(path, max_position_embeddings=T, rope_parameters=dict(
        rope_type="yarn", factor=3.0, original_max_position_embeddings=OLD, rope_theta=500.0)).eval()
    x = ids(2)
    assert_close(ours.eval()(x), theirs(x).logits)
    dict_form = '--rope_scaling={"rope_type": "yarn", "factor": 3.0, "truncate": false}'  # JSON, as HF writes it
    cfg = config.load([f"--init_from={path}", f"--block_size={T}", dict_form], extra=sft.EXTRA, world=1)
    weights.configure(cfg)
    assert cfg.rope_scaling == dict(rope_type="yarn", factor=3.0, truncate=False, original_max_position_embeddings=OLD)


def test_learned_positions_from_an_hf_folder(tmp_path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=32)
                                 ).save_pretrained(str(tmp_path))
    cfg = config.load([f"--init_from={tmp_path}", "--block_size=64"], extra=sft.EXTRA, world=1)
    with pytest.raises(config.ConfigError, match="block_size=64 > the 32 positions of .* learned position table"):
        weights.configure(cfg)


def stage(*argv):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), *argv, *SFT], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def our_checkpoint(path, **kw):
    cfg = config.load([], extra=sft.EXTRA, world=1)
    for k, v in {**TINY, **kw}.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    checkpoint.save(str(path), 1, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg, run_id="init")
    return str(path)


def test_sft_beyond_the_model_positions(tmp_path):
    init = our_checkpoint(tmp_path / "init")
    rc, out, err = stage(f"--init_from={init}", f"--out_dir={tmp_path / 'yarn'}", "--block_size=128",
                         "--rope_scaling=yarn", f"--export_hf={tmp_path / 'hf'}")
    assert rc == 0, err[-3000:]
    assert out.count("training at 128 positions, the model's 32, rope_scaling=yarn (factor 4)\n") == 1
    assert " rows of 129 tokens " in out
    saved = json.loads((tmp_path / "yarn" / "step_000001" / "config.json").read_text())
    assert saved["block_size"] == 128 and saved["rope_scaling"] == dict(rope_type="yarn", factor=4.0,
                                                                        original_max_position_embeddings=32)
    model = Transformer(ModelConfig.from_cfg(config.Config(**saved)))
    weights.load_model(str(tmp_path / "yarn" / "step_000001"), model)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(model.eval()(x)[..., :saved["vocab_size"]], theirs(x).logits)

    rc, out, err = stage(f"--init_from={init}", f"--out_dir={tmp_path / 'plain'}", "--block_size=128")
    assert rc == 0, err[-3000:]
    assert out.count("training at 128 positions, the model's 32: positions 32..127 were never trained and RoPE "
                     "is not scaled (--rope_scaling=yarn, or linear, dynamic, llama3, scales it)\n") == 1


def test_learned_positions_refuse_or_cut(tmp_path):
    init = our_checkpoint(tmp_path / "gpt", **LEARNED)
    rc, out, err = stage(f"--init_from={init}", f"--out_dir={tmp_path / 'run'}", "--block_size=64")
    assert rc == 2 and err.strip().splitlines() == [
        f"error: block_size=64 > the 32 positions of init_from={init}/step_000001's learned position table "
        "(GPT-2 style: it cannot grow): set block_size <= 32"]
    cfg = config.load([f"--init_from={init}", "--block_size=16"], extra=sft.EXTRA, world=1)
    weights.configure(cfg)
    assert cfg.block_size == 16
    mcfg = ModelConfig.from_cfg(config.Config(**hf.read_config(cfg.init_from)))  # (its 32 positions)
    saved = checkpoint.read_weights(cfg.init_from, **weights.reference(mcfg))
    model = Transformer(ModelConfig.from_cfg(cfg))
    weights.loader(cfg, parallel.init(cfg))(model)
    assert torch.equal(model.pos_emb.weight, saved["pos_emb.weight"][:16])
