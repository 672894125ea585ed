# A tiny BERT pretrained by masked-language modelling (objective="mlm") on the tiny corpus, CPU, minutes.
#   python pretrain.py configs/tiny_bert.py        (torchrun --nproc_per_node=2 ... for data parallel)
# 15% of the positions are predicted (80% [MASK], 10% a random id, 10% kept); [MASK] is the id past the
# tokenizer's. The validation loss is the mean over the predicted tokens of fixed masks.
from configs.tiny import data, tokenizer, tokenizer_vocab, max_docs, clean, dedup  # the tiny corpus
from configs.tiny import (batch_size, micro_batch_size, max_steps, warmup_steps, eval_every,
                          eval_batches, ckpt_every, log_every)  # and its schedule
out_dir = "out/tiny_bert"
objective = "mlm"
mask_rate = 0.15
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
activation = "gelu"        # BERT's (exact) GELU; the rest of its shape is fixed: post-norm LayerNorm, biases, tied head
lr = 1e-3
weight_decay = 0.01
