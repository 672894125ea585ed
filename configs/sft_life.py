# A model's life on one GPU, step 2: fine-tune the pretrained model on Countdown (reach the target from three
# numbers in [1, 199], a target up to 199, with + - *), worked one combination a line ("75 - 49 = 26\n26 + 57 = 83\n
# #### 75 - 49 + 57"). The task holds 3,752,106 problems; the chain sees at most 16,000 (SFT) + 2,000 (DPO) +
# 16,384 (GRPO) = 34,384 of its training split (1/109 of it), and is judged on 500 held-out ones (a hash split:
# never trained on).
#   python sft.py configs/sft_life.py        (after python pretrain.py configs/life.py)
init_from = "out/life"
out_dir = "out/sft_life"
task = "countdown"
task_args = dict(numbers=3, max_number=199, max_target=199, ops="+-*")
n_train = 16000
n_eval = 500               # held-out problems (a hash split: never trained on), answered greedily before and after
eval_tokens = 64
eval_batch = 250
pack = True
batch_size = 32
micro_batch_size = 16
max_steps = 200            # ~6 epochs of the 16,000 conversations
lr = 3e-4
warmup_steps = 15
schedule = "cosine"
weight_decay = 0.0
compile = True
ckpt_every = 0
log_every = 10
