# Supervised fine-tuning of the tiny pretrained model on the offline Arithmetic task (posttrain/tasks.py):
# "What is 13 + 7?" -> "20", in our chat template; CPU, a few minutes.
#   python pretrain.py configs/tiny.py            (or torchrun --nproc_per_node=2 ...)
#   torchrun --nproc_per_node=2 sft.py configs/sft_tiny.py
#   python sample.py out/sft_tiny --chat --prompt="What is 12 + 5?"
# The model shape and tokenizer come from init_from (hf.configure); the chat template's special
# tokens are added to its vocabulary. Held-out accuracy is printed before and after.
init_from = "out/tiny"
out_dir = "out/sft_tiny"
task = "arithmetic"
n_train = 20000            # generated conversations (sampled from ~590 training questions)
n_eval = 200               # held-out questions (the task holds ~60 of them back)
pack = True               # whole conversations side by side in rows (block-diagonal attention)
batch_size = 16            # rows of 129 tokens: ~100 conversations per step
micro_batch_size = 8
max_steps = 300
lr = 1e-3
warmup_steps = 20
schedule = "cosine"
weight_decay = 0.0
log_every = 25
ckpt_every = 150
