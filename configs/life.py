# A model's whole life on one GPU, step 1 of 5: pretrain configs/small.py's shape briefly (~2 min on an H200).
#   python pretrain.py configs/life.py && python sft.py configs/sft_life.py && python dpo.py configs/dpo_life.py \
#     && python grpo.py configs/grpo_life.py && python eval.py ... (docs/life.md)
# 300 steps of 128 x 1024 tokens of the interpreter's Python files (no cleaning: it is the quick version).
from configs.small import (tokenizer, tokenizer_vocab, pad_vocab_multiple, n_layer, n_head, n_kv_head, n_embd,
                           block_size, activation, norm, pos_emb, fp32_residual)  # small.py's model, unchanged
out_dir = "out/life"
data = "python"
batch_size = 128
micro_batch_size = 32
max_steps = 300
lr = 1e-3
warmup_steps = 30
schedule = "cosine"
weight_decay = 0.1
compile = True
eval_every = 100
eval_batches = 20
ckpt_every = 0
sample_tokens = 64
