# A model's life on one GPU, step 2: fine-tune the pretrained model to answer six-term sums of digits in
# worked steps ("8 + 4 = 12\n12 - 0 = 12\n...\n#### 11"). The task holds 15M problems; the run sees 16,000
# (SFT) + 2,000 (DPO) + 4,096 (GRPO) of its training split: memorisation cannot explain a held-out gain.
#   python sft.py configs/sft_life.py        (after python pretrain.py configs/life.py)
init_from = "out/life"
out_dir = "out/sft_life"
task = "arithmetic"
task_args = dict(max_operand=9, terms=6, worked=True)
n_train = 16000
n_eval = 500               # held-out problems (a hash split: never trained on), answered greedily before and after
eval_tokens = 64
eval_batch = 250
pack = True
batch_size = 32
micro_batch_size = 16
max_steps = 100            # ~3 epochs of the 16,000 conversations
lr = 3e-4
warmup_steps = 10
schedule = "cosine"
weight_decay = 0.0
compile = True
ckpt_every = 0
log_every = 10
