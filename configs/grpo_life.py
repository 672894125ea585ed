# A model's life on one GPU, step 4: GRPO on the same task from the DPO model (itself the SFT model,
# aligned): 32 problems x 8 samples a step, reward 1 for the right '#### N' after the problem's own steps
# (check_steps: a lucky answer after a wrong step earns 0).
#   python grpo.py configs/grpo_life.py      (after dpo.py configs/dpo_life.py)
init_from = "out/dpo_life"
out_dir = "out/grpo_life"
task = "arithmetic"
task_args = dict(max_operand=9, terms=6, worked=True, check_steps=True)
train_prompts = 4096
eval_prompts = 500
batch_size = 256
group_size = 8
micro_batch_size = 128
max_new_tokens = 64
temperature = 1.0
loss_type = "dapo"
clip_high = 0.28
lr = 1e-5
warmup_steps = 10
schedule = "constant"
weight_decay = 0.0
max_steps = 250
eval_every = 50
log_every = 10
ckpt_every = 0
compile = False            # prompt lengths vary per step: eager learning, captured (uncompiled) decode steps
