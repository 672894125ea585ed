# A model's life on one GPU, step 2: fine-tune the pretrained model to answer multi-step arithmetic in
# worked steps ("23 + 48 = 71\n71 - 15 = 56\n#### 56"). The task holds 2.5M problems; the run sees 16,000
# (SFT) + 2,000 (DPO) + 4,096 (GRPO) of its training split: memorisation cannot explain a held-out gain.
#   python sft.py configs/sft_life.py        (after python pretrain.py configs/life.py)
init_from = "out/life"
out_dir = "out/sft_life"
task = "multistep"
n_train = 16000
n_eval = 500               # held-out problems (a hash split: never trained on), answered greedily before and after
eval_tokens = 48
eval_batch = 250
pack = True
batch_size = 32
micro_batch_size = 16
max_steps = 100            # ~3 epochs of the 16,000 conversations
lr = 1e-4
warmup_steps = 10
schedule = "cosine"
weight_decay = 0.0
compile = True
ckpt_every = 0
log_every = 10
