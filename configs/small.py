# GPT-2-small-class LLaMA-style model (about 125M parameters) for 2 GPUs, on every .py file this
# interpreter can import (data="python": corpora/corpus.py), cleaned (corpora/clean.py), exactly deduplicated, half
# the training documents in fill-in-the-middle layout in fragments of <= 2000 characters (corpora/fim.py).
#   torchrun --nproc_per_node=2 pretrain.py configs/small.py
# Point `data` at a larger corpus (a folder of text/jsonl/parquet, or hf:<dataset>) for a real run.
# What to expect (BENCHMARKS.md): ~1.25M tokens/s on 2 H200s; the corpus is read several times.
out_dir = "out/small"
data = "python"
clean = True
dedup = "exact"
fim_rate = 0.5
fim_fragment = 2000
tokenizer = "cl100k_base"
tokenizer_vocab = 32768
pad_vocab_multiple = 128
n_layer = 12
n_head = 12
n_kv_head = 4
n_embd = 768
block_size = 1024
activation = "swiglu"
norm = "rmsnorm"
pos_emb = "rope"
fp32_residual = False      # residual stream in bf16 under autocast, as Megatron-LM: ~4% faster (BENCHMARKS.md)
batch_size = 256           # 256 x 1024 = 262k tokens per optimizer step
micro_batch_size = 32
max_steps = 2000
lr = 1e-3
warmup_steps = 100
schedule = "cosine"
weight_decay = 0.1
compile = True
eval_every = 250
ckpt_every = 500
