# A model's life on one GPU, step 4: GRPO on held-out-free multi-step arithmetic from the DPO model
# (itself the SFT model, aligned): 32 problems x 8 samples a step, reward 1 for the right '#### N'.
#   python grpo.py configs/grpo_life.py      (after dpo.py configs/dpo_life.py)
init_from = "out/dpo_life"
out_dir = "out/grpo_life"
task = "multistep"
train_prompts = 4096
eval_prompts = 500
batch_size = 256
group_size = 8
micro_batch_size = 128
max_new_tokens = 48
temperature = 1.0
loss_type = "dapo"
clip_high = 0.28
lr = 1e-5
warmup_steps = 10
schedule = "constant"
weight_decay = 0.0
max_steps = 150
eval_every = 50
log_every = 10
ckpt_every = 0
compile = False            # prompt lengths vary per step: eager learning, captured (uncompiled) decode steps
