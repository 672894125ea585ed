# A tiny T5 (gated GELU, the head tied to the embedding) pretrained by span corruption (objective="span").
#   python pretrain.py configs/tiny_t5.py
# 15% of each window's tokens in spans of mean length 3, each span a sentinel in the input and
# "sentinel, span" in the target (T5's rule); rows read more than seq_len tokens so the input fits it.
from configs.tiny import data, tokenizer, tokenizer_vocab, max_docs, clean, dedup  # the tiny corpus
from configs.tiny import (batch_size, micro_batch_size, max_steps, warmup_steps, eval_every,
                          eval_batches, ckpt_every, log_every)  # and its schedule
out_dir = "out/tiny_t5"
objective = "span"
noise_density = 0.15
mean_span = 3.0
n_layer = 3                # encoder blocks (as many decoder blocks)
n_head = 4
n_embd = 128
ffn_hidden = 256
block_size = 128           # the corrupted inputs' length
activation = "gated-gelu"  # T5 v1.1's MLP (relu: v1.0's)
tie_embeddings = True      # the head is the embedding, fed d_model**-0.5-scaled states (v1.0; False: v1.1's own head,
                           # N(0, 1) at init as HF's: a first loss near 40 at this width)
lr = 1e-3
weight_decay = 0.0
