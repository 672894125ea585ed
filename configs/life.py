# A model's whole life on one GPU, step 1 of 5: pretrain configs/small.py's shape briefly (~2 min on an H200).
#   python pretrain.py configs/life.py && python sft.py configs/sft_life.py && python dpo.py configs/dpo_life.py \
#     && python grpo.py configs/grpo_life.py && python eval.py ... (README: "A model's life on one GPU")
# 300 steps of 128 x 1024 tokens of the interpreter's Python files (no cleaning: it is the quick version).
out_dir = "out/life"
data = "python"
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
fp32_residual = False
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
