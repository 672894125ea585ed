# A model's life on one GPU, step 3: DPO on the SFT model: the worked solution chosen, the same plan with one
# op changed (worked through correctly to a number that is not the target) rejected, with RPO's NLL on the
# chosen answers so that the policy's own preference is kept.
#   python dpo.py configs/dpo_life.py        (after sft.py configs/sft_life.py)
from configs.sft_life import task, task_args  # the same Countdown as SFT
init_from = "out/sft_life"
out_dir = "out/dpo_life"
n_pairs = 2000
eval_pairs = 200
beta = 0.1
loss_type = "sigmoid"
rpo_alpha = 1.0            # 2.0: the task's greedy accuracy -1.0 points where 1.0 lost 3.4 (one SFT start, BENCHMARKS.md)
batch_size = 32
micro_batch_size = 16
max_steps = 60
lr = 5e-6
warmup_steps = 5
schedule = "cosine"
weight_decay = 0.0
eval_every = 30
log_every = 10
ckpt_every = 0
