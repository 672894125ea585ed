# A model's life on one GPU, step 4: GRPO on the same task from the DPO model (itself the SFT model,
# aligned): 128 problems x 8 samples a step, reward 1 when the last line '#### <expression>' reaches the
# target (each number at most once). 1,024 completions a step at lr 5e-6: every earlier run, at 256 a step
# and lr 1e-5, lost greedy accuracy before it gained (a small batch's step is mostly noise: BENCHMARKS.md).
#   python grpo.py configs/grpo_life.py      (after dpo.py configs/dpo_life.py)
from configs.sft_life import task, task_args  # the same Countdown as SFT
init_from = "out/dpo_life"
out_dir = "out/grpo_life"
train_prompts = 16384
eval_prompts = 500
batch_size = 1024           # completions per step: 128 problems x 8
group_size = 8
micro_batch_size = 256
max_new_tokens = 64
temperature = 1.0
loss_type = "dapo"
clip_high = 0.28
lr = 5e-6
warmup_steps = 10
schedule = "constant"
weight_decay = 0.0
max_steps = 200
eval_every = 50
log_every = 10
ckpt_every = 0
compile = False            # prompt lengths vary per step: eager learning, captured (uncompiled) decode steps
