# GPT-2 (124M) style: learned positions, LayerNorm, GELU, biases, tied embeddings, pre-norm.
#   torchrun --nproc_per_node=2 pretrain.py configs/gpt2.py
# OpenAI's own GPT-2 BPE: tokenizer = "gpt2" works when tiktoken's cache holds it (needs network once);
# offline, the first 50256 merges of cl100k_base + EOS give a vocabulary of GPT-2's size.
out_dir = "out/gpt2"
tokenizer = "cl100k_base"
tokenizer_vocab = 50257
pad_vocab_multiple = 64    # 50257 -> 50304 rows, a multiple of 64 for fast matmuls
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
pos_emb = "learned"
norm = "layernorm"
activation = "gelu"
bias = True
tie_embeddings = True
dropout = 0.0
batch_size = 512           # 0.5M tokens per step, as GPT-2/3 small
micro_batch_size = 32
max_steps = 5000
lr = 6e-4
warmup_steps = 700
weight_decay = 0.1
compile = True
eval_every = 250
ckpt_every = 1000
