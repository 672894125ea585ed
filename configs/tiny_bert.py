# A tiny BERT pretrained by masked-language modelling (objective="mlm") on the tiny corpus, CPU, minutes.
#   python pretrain.py configs/tiny_bert.py        (torchrun --nproc_per_node=2 ... for data parallel)
# 15% of the positions are predicted (80% [MASK], 10% a random id, 10% kept); [MASK] is the id past the
# tokenizer's. The validation loss is the mean over the predicted tokens of fixed masks.
out_dir = "out/tiny_bert"
objective = "mlm"
mask_rate = 0.15
data = "stdlib"
tokenizer = "cl100k_base"
tokenizer_vocab = 4096
max_docs = 400
clean = True
dedup = "near"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
activation = "gelu"        # BERT's (exact) GELU; the rest of its shape is fixed: post-norm LayerNorm, biases, tied head
batch_size = 16
micro_batch_size = 8
max_steps = 300
lr = 1e-3
warmup_steps = 20
weight_decay = 0.01
eval_every = 100
eval_batches = 8
ckpt_every = 150
log_every = 25
