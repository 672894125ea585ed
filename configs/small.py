# GPT-2-small-class LLaMA-style model (about 125M parameters) for 2 GPUs.
#   torchrun --nproc_per_node=2 pretrain.py configs/small.py
# The corpus: every .py file this interpreter can import (standard library + installed packages),
# deduplicated, in a fixed shuffled order, no top-level package above 10% of it (corpus.py). On the
# CPU machine (Python 3.11, torch + transformers + ... installed) that is 16,516 files = 68.4M train
# tokens with this tokenizer, 61.6M after cleaning (below): 2000 steps of 262k tokens repeat it ~8.5
# times; slim installs give less.
# Point `data` at a larger corpus (a folder of text/jsonl/parquet, or hf:<dataset>) for a real run.
# Cleaned (clean.py) and exactly deduplicated before tokenization: on the CPU machine 850 of 16,516
# files go (764 auto-generated, e.g. transformers' modeling files generated from modular ones; 32
# encoded data; 20 lines over 1000 chars; ...): 61.6M instead of 68.4M train tokens, prepared in
# 93 s instead of 72 s (2 busy cores). dedup="near" drops 375 more near-copies (2.3%) for 185 s:
# prepared data is reused, but every fresh machine pays it. Half the training documents are in
# fill-in-the-middle layout (fim.py; validation stays plain; ~5 more tokens per FIM sequence), in
# fragments of <= 2000 characters (~530 tokens at 3.7 characters per token): whole files laid out
# once (fim_fragment=0, 4.2k tokens on average) put only 7% of PSM middle tokens in a 1024-token
# window that also holds the end of their prefix and the start of their suffix; fragments, 73%.
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
