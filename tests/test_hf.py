"""hf.py against transformers itself, offline (tiny random models and tokenizers built locally).

Proves:
- import: for GPT-2, LLaMA, LLaMA with Llama-3.1 rope scaling, Qwen2 (q/k/v bias, tied head,
  sharded safetensors) and Mistral, our logits equal transformers' on the same weights and inputs
  (fp32, max abs diff <= 1e-4), with a vocabulary that is not a multiple of 64 (padded rows);
- export: export_hf -> AutoModelForCausalLM.from_pretrained gives those logits again, also for
  models configured here (exact gelu, relu2, geglu, full biases, MQA);
- greedy generation from an imported model equals transformers' generate(do_sample=False) token
  for token (also left-padded prompts of different lengths);
- pytorch_model.bin, bf16 + tied loading, and the shard_fn hook: every Part read in slices equals
  the same rows/columns of the whole tensor (what tensor parallelism will read);
- unsupported architectures, config fields and non-exportable configs raise errors naming them;
- tokenizers: ids equal the HF tokenizer's on a mixed sample (code, unicode, whitespace runs) for
  vocab.json + merges.txt, tokenizer.json (GPT-2 ByteLevel; Llama-3-style Split regex + NFC), a
  Llama-3 tiktoken rank file (cl100k ranks) and a vocabulary whose ids do not follow merge order;
  special tokens and the chat template carry over; our tiktoken tokenizer exported as tokenizer.json
  gives tiktoken's ids in transformers; unreadable formats raise naming the format;
- init_from=<HF folder>: pretrain.py starts from the HF weights with the folder's tokenizer, also
  under TP=2 (each rank reads its slices; same weights and first loss as one process), and
  sample.py reads both the HF folder and the resulting run.
TP=2 logits parity with transformers: tests/test_hf_tp.py.
"""
import base64
import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import generate  # noqa: E402
import hf  # noqa: E402
import tokenizer  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

transformers.logging.set_verbosity_error()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
V = 97  # not a multiple of 64: our embedding/head get padded rows
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
             eos_token_id=None)
ARCHS = {  # name -> (config class, model class, kwargs, save_pretrained kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, rms_norm_eps=1e-5, rope_theta=500.0), {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, rope_scaling=LLAMA3), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SMALL, tie_word_embeddings=True), {"max_shard_size": "20KB"}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(SMALL, sliding_window=64), {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   initializer_range=0.1, bos_token_id=None, eos_token_id=None), {}),
}
MIXED = ("def f(x):\n    return x**2  # square\n\n\n\tif a != b:\n        print(f'{a!r} -> {b}')\n"
         "class Foo(Bar):  \n\t\t  pass\r\n"
         "Unicode: café naïve résumé, 日本語のテキスト, русский текст, ελληνικά, emoji 🤖🚀👍🏽, math ∑∫√≠\n"
         "whitespace   runs\t\t\tand\n\n\n   trailing   \r\n  numbers 1234567 3.14159 0x1F and don't we'll I'm\n"
         "   \u00a0nbsp  e\u0301 (decomposed) \u2028 end    ")


def stdlib_text(name, n=20000):
    with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
        return f.read()[:n]


SAMPLE = MIXED + stdlib_text("argparse.py", 6000)  # code the tokenizers were not trained on


def hf_ids(tok, text, special=False):
    return tok(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]


# ----------------------------------------------------------------------------- models

def build(name, folder, **over):
    """A tiny random transformers model of architecture `name`, saved into folder -> (model, folder)."""
    config_cls, model_cls, kw, save_kw = ARCHS[name]
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kw, **over})).eval()
    with torch.no_grad():  # non-trivial biases and norm weights (HF initialises them to 0 and 1)
        for n, p in ref.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in n or "ln_" in n:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(folder), **save_kw)
    return ref, str(folder)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(name, transformers model in eval mode, its saved folder)."""
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param)))


def ids(seed, shape=(2, 48)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def assert_close(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


@torch.no_grad()
def test_import_logits_match(arch):
    name, ref, folder = arch
    ours = hf.load_hf(folder)
    assert ours.cfg.vocab_size == V and ours.cfg.padded_vocab == 128
    x = ids(1)
    assert_close(ours(x), ref(x).logits)


@torch.no_grad()
def test_export_round_trip(arch, tmp_path):
    name, ref, folder = arch
    ours = hf.load_hf(folder)
    model_type = "mistral" if name == "mistral" else None
    hf.export_hf(ours, str(tmp_path), model_type=model_type)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    expected = {"llama3": "llama"}.get(name, name)
    assert back.config.model_type == expected
    x = ids(2)
    assert_close(back(x).logits, ref(x).logits)
    assert_close(hf.load_hf(str(tmp_path))(x), ref(x).logits)  # and back into ours


@pytest.mark.parametrize("kw, model_type", [
    (dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True), "gpt2"),
    (dict(pos_emb="learned", norm="layernorm", activation="relu2", bias=True, tie_embeddings=True), "gpt2"),
    (dict(activation="geglu", bias=True, n_kv_head=2, tie_embeddings=True), "llama"),
    (dict(qkv_bias=True, n_kv_head=1), "qwen2"),
])
@torch.no_grad()
def test_export_our_configs(kw, model_type, tmp_path):
    """Models born here (exact gelu, relu2, geglu, full biases, MQA) load in transformers unchanged."""
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(vocab_size=V, n_layer=2, n_head=4, n_embd=32, block_size=32, init_std=0.2, **kw))
    for n, p in ours.named_parameters():
        if n.endswith("bias"):
            p.normal_(0, 0.3)
    hf.export_hf(ours.eval(), str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert theirs.config.model_type == model_type
    x = ids(7, (2, 32))
    assert_close(theirs(x).logits, ours(x))


@torch.no_grad()
def test_greedy_generation_matches(arch):
    name, ref, folder = arch
    ours = hf.load_hf(folder)
    x = ids(3, (3, 6))
    theirs = ref.generate(x, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(generate.generate(ours, x, 12, vocab=V, temperature=0), theirs)
    if name in ("llama", "gpt2"):  # left-padded prompts of different lengths
        mask = torch.ones_like(x)
        mask[0, :3] = mask[1, :1] = 0
        theirs = ref.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        got = generate.generate(ours, x, 12, vocab=V, temperature=0, attention_mask=mask)
        assert torch.equal(got[:, 6:], theirs[:, 6:])


@torch.no_grad()
def test_llama3_rope_scaling_is_exercised(tmp_path):
    """Parity above would be vacuous if the scaling changed nothing at these lengths."""
    a = hf.load_hf(build("llama3", tmp_path)[1])
    assert a.cfg.rope_scaling["rope_type"] == "llama3"
    b = Transformer(ModelConfig(**{**vars(a.cfg), "rope_scaling": {}}))
    b.load_state_dict(a.state_dict())
    x = ids(4)
    assert (a(x) - b.eval()(x)).abs().max() > 100 * 1e-4


@torch.no_grad()
def test_sharded_bin_bf16_and_tied(tmp_path):
    ref, folder = build("qwen2", tmp_path / "qwen2")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    x = ids(5)
    # pytorch_model.bin instead of safetensors
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    assert_close(hf.load_hf(str(tmp_path))(x), ref(x).logits)  # tmp_path holds only config.json and the .bin
    half = hf.load_hf(folder, dtype=torch.bfloat16)
    assert half.head.weight is half.tok_emb.weight and half.tok_emb.weight.dtype == torch.bfloat16
    assert half.rope_cos.dtype == torch.float32
    assert_close(half(x).float(), ref(x).logits, tol=0.1)


@torch.no_grad()
def test_shard_fn_reads_slices(arch):
    """Every part read in two row halves (and 2-D parts in two column halves) equals the whole."""
    name, ref, folder = arch
    seen = []

    def shard_fn(param, part):
        whole = part[:]
        assert whole.shape == part.shape
        h = part.shape[0] // 2
        assert torch.equal(torch.cat([part[:h], part[h:]]), whole)
        if len(part.shape) == 2:
            c = part.shape[1] // 2
            assert torch.equal(torch.cat([part[:, :c], part[:, c:]], dim=1), whole)
            assert torch.equal(part[1:h, c:], whole[1:h, c:])
        seen.append(param)
        return whole

    ours = hf.load_weights(folder, Transformer(hf.config_from_hf(hf.read_config(folder))), shard_fn)
    assert seen.count("blocks.0.attn.qkv.weight") == 3  # q, k, v parts (GPT-2: column ranges of c_attn)
    x = ids(6)
    assert_close(ours.eval()(x), ref(x).logits)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("over, match", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "bert"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),  # (the others: test_rope_scaling.py)
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"head_dim": 16}, "head_dim"),
])
def test_unsupported_configs(over, match):
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": 64}
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf({**llama, **over}, block_size=64)


def test_unsupported_gpt2_config():
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        hf.config_from_hf({"model_type": "gpt2", "vocab_size": V, "n_embd": 32, "n_layer": 1, "n_head": 4,
                           "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="n_positions"):
        hf.config_from_hf({"model_type": "gpt2", "vocab_size": V, "n_embd": 32, "n_layer": 1, "n_head": 4,
                           "n_positions": 64}, block_size=128)


@pytest.mark.parametrize("over, match", [
    ({"activation": "relu2"}, "activation"), ({"prenorm": False}, "prenorm"), ({"qk_norm": True}, "qk_norm"),
    ({"pos_emb": "learned", "norm": "layernorm", "activation": "gelu", "bias": False}, "bias"),
    ({"norm": "layernorm"}, "layernorm"),
])
def test_unexportable_configs(over, match, tmp_path):
    model = Transformer(ModelConfig(**{"vocab_size": V, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16,
                                       **over}))
    with pytest.raises(ValueError, match=match):
        hf.export_hf(model, str(tmp_path))


def test_missing_and_unknown_tensors(tmp_path):
    ref, folder = build("llama", tmp_path / "llama")
    from safetensors.torch import save_file
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # e.g. a Qwen3 checkpoint labelled llama
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    with pytest.raises(ValueError, match="up_proj.*q_norm"):
        hf.load_hf(str(tmp_path))


# ----------------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def texts():
    return [stdlib_text(n) for n in ("os.py", "json/__init__.py", "textwrap.py", "string.py")] + [MIXED]


@pytest.fixture(scope="module")
def byte_level(texts):
    """A GPT-2-style byte-level BPE trained locally (tokenizers' ByteLevelBPETokenizer)."""
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=700, min_frequency=2, special_tokens=["<|endoftext|>"])
    return tok


def check_same(ours, theirs, text=SAMPLE):
    a, b = ours.encode(text), hf_ids(theirs, text)
    assert a == b, next((i, ours.decode(a[i:i + 3]), theirs.decode(b[i:i + 3]))
                        for i in range(min(len(a), len(b)) + 1) if a[i:i + 1] != b[i:i + 1])
    assert ours.decode(a) == theirs.decode(b)


def test_vocab_json_merges_txt(byte_level, tmp_path):
    byte_level.save_model(str(tmp_path))
    ours = tokenizer.load_hf_tokenizer(str(tmp_path))
    assert ours.ids is None  # ids follow merge order: tiktoken ranks are the ids
    check_same(ours, transformers.GPT2Tokenizer.from_pretrained(str(tmp_path)))
    assert ours.decode(ours.encode(MIXED)) == MIXED
    assert ours.eos_id == ours.special_tokens["<|endoftext|>"] == 0


def test_ids_out_of_merge_order(byte_level, tmp_path):
    byte_level.save_model(str(tmp_path))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    merges = (tmp_path / "merges.txt").read_text().split("\n")
    a, b = ("".join(merges[i].split(" ")) for i in (3, 200))  # two merge results trade ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    ours = tokenizer.load_hf_tokenizer(str(tmp_path))
    assert ours.ids is not None
    check_same(ours, transformers.GPT2Tokenizer.from_pretrained(str(tmp_path)))


def test_tokenizer_json_byte_level(byte_level, tmp_path):
    byte_level.save(str(tmp_path / "tokenizer.json"))
    check_same(tokenizer.load_hf_tokenizer(str(tmp_path)),
               transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json")))


def test_tokenizer_json_split_regex_nfc_chat(texts, tmp_path):
    """Llama-3 / Qwen2 style: NFC, an isolating Split regex, ByteLevel without regex, added tokens,
    a chat template in tokenizer_config.json."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tokenizer.LLAMA3_PAT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=800, min_frequency=2,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # ids after the BPE vocabulary
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": template}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = tokenizer.load_hf_tokenizer(str(tmp_path))
    check_same(ours, theirs)
    assert ours.nfc and ours.chat_template == template
    assert ours.eos_id == theirs.convert_tokens_to_ids("<|im_end|>") == ours.special_tokens["<|im_end|>"]
    chat = theirs.apply_chat_template([{"role": "user", "content": "Wie geht's? 🤖"}], tokenize=False,
                                      add_generation_prompt=True)
    assert ours.encode(chat, special=True) == hf_ids(theirs, chat, special=True)
    assert ours.encode(chat) == hf_ids(theirs, chat)  # special text read as text, like tokenizer.Tokenizer


def write_tiktoken_file(path, enc):
    with open(path, "w") as f:
        for t, r in sorted(enc._mergeable_ranks.items(), key=lambda x: x[1]):
            f.write(f"{base64.b64encode(t).decode()} {r}\n")


def test_tiktoken_rank_file(tmp_path):
    """Llama-3's tokenizer.model format, filled with cl100k's first 4095 ranks."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    cl = tokenizer.get_tokenizer("cl100k_base", 4096)
    write_tiktoken_file(tmp_path / "tokenizer.model", cl.enc)
    ours = tokenizer.load_hf_tokenizer(str(tmp_path))
    specials = tokenizer.llama3_specials(4095)
    assert ours.special_tokens == specials and ours.bos_id == 4095 and ours.eos_id == 4096
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=convert.TikTokenConverter(
        vocab_file=str(tmp_path / "tokenizer.model"), pattern=tokenizer.LLAMA3_PAT,
        extra_special_tokens=list(specials)).converted())
    check_same(ours, theirs)
    assert ours.encode(SAMPLE) == cl.encode(SAMPLE)  # Llama-3's split pattern = cl100k's on this text
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert ours.encode(text, special=True) == hf_ids(theirs, text, special=True)


def test_export_tokenizers(byte_level, tmp_path):
    """A tiktoken tokenizer is written as tokenizer.json that transformers reads with tiktoken's ids;
    an HF tokenizer's own files are copied."""
    cl = tokenizer.get_tokenizer("cl100k_base", 4096)
    model = Transformer(ModelConfig(vocab_size=cl.n_vocab, n_layer=1, n_head=2, n_embd=16, block_size=16))
    hf.export_hf(model, str(tmp_path / "a"), tokenizer=cl)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert hf_ids(theirs, SAMPLE) == cl.encode(SAMPLE) == tokenizer.load_hf_tokenizer(str(tmp_path / "a")).encode(SAMPLE)
    assert theirs.eos_token_id == cl.eos_id
    assert json.loads((tmp_path / "a" / "config.json").read_text())["eos_token_id"] == cl.eos_id
    byte_level.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = tokenizer.load_hf_tokenizer(str(tmp_path))
    hf.export_hf(model, str(tmp_path / "b"), tokenizer=tok)
    assert os.path.isfile(tmp_path / "b" / "tokenizer.json")
    check_same(tok, transformers.AutoTokenizer.from_pretrained(str(tmp_path / "b")))


def test_unreadable_tokenizers(tmp_path):
    from tokenizers import models, pre_tokenizers
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ValueError, match="SentencePiece"):
        tokenizer.load_hf_tokenizer(str(tmp_path / "sp"))
    cases = {"WordPiece": models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
             "Unigram": models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0),
             "SentencePiece-style": models.BPE({"<unk>": 0, "a": 1}, [], byte_fallback=True)}
    for name, m in cases.items():
        (tmp_path / name).mkdir()
        tok = tokenizers.Tokenizer(m)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.save(str(tmp_path / name / "tokenizer.json"))
        with pytest.raises(ValueError, match=name):
            tokenizer.load_hf_tokenizer(str(tmp_path / name))
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer.load_hf_tokenizer(str(tmp_path / "none"))


# ----------------------------------------------------------------------------- init_from

def test_init_from_hf_folder_in_pretrain_and_sample(byte_level, tmp_path):
    """An HF folder (GPT-2 weights + tokenizer.json) as init_from: the run's model is the HF model
    (config from config.json, weights loaded, vocabulary = the folder's tokenizer's), also under
    TP=2 (each rank reads its slices: same weights, same first loss), and the checkpoint samples
    with that tokenizer."""
    n_vocab = byte_level.get_vocab_size()
    _, ref = build("gpt2", tmp_path / "hfmodel", vocab_size=n_vocab, n_layer=1)
    byte_level.save(os.path.join(ref, "tokenizer.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, name in enumerate(("os.py", "textwrap.py", "string.py")):
        (corpus / f"{i}.txt").write_text(stdlib_text(name, 4000))
    out, out_tp = tmp_path / "run", tmp_path / "run_tp2"
    for path, launch in ((out, []), (out_tp, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        r = subprocess.run([sys.executable, *launch, os.path.join(ROOT, "pretrain.py"), f"--init_from={ref}",
                            f"--data={corpus}", f"--data_dir={tmp_path / 'data'}", f"--out_dir={path}",
                            "--max_steps=1", "--lr=1e-9", "--warmup_steps=0", "--batch_size=2", "--micro_batch_size=2",
                            "--block_size=32", "--eval_every=0", "--sample_tokens=0", "--progress=False"]
                           + (["--tp=2"] if launch else []), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "step_000001"
    saved = json.loads((ckpt / "config.json").read_text())
    assert (saved["n_layer"], saved["pos_emb"], saved["activation"], saved["vocab_size"], saved["block_size"]) \
        == (1, "learned", "gelu_tanh", n_vocab, 32)
    from safetensors.torch import load_file
    start = hf.load_hf(ref, block_size=32).state_dict()
    for run in (out, out_tp):
        trained = load_file(str(run / "step_000001" / "model.safetensors"))
        assert set(trained) <= set(start)
        for k, v in trained.items():  # one step at lr 1e-9: still the HF weights
            assert_close(v, start[k], tol=1e-6)
    loss, loss_tp = (next(r["loss"] for r in map(json.loads, (run / "train_metrics.jsonl").open()) if "loss" in r)
                     for run in (out, out_tp))
    assert abs(loss - loss_tp) <= 1e-5 * loss, (loss, loss_tp)
    for path in (ref, str(out)):
        s = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), path, "--prompt=def ", "--tokens=5",
                            "--device=cpu"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert s.returncode == 0 and "--- sample 0 ---\ndef " in s.stdout, s.stderr[-3000:]
