# GRPO on the offline Arithmetic task (posttrain/tasks.py) from the tiny model halfway through its SFT: CPU, minutes.
# Each step: 16 questions x 16 sampled answers, rewarded 1 for the right number; every eval_every
# steps the held-out questions (never trained on) are answered 16 times each and once greedily.
#   python pretrain.py configs/tiny.py && python sft.py configs/sft_tiny.py     (or torchrun ... each)
#   python grpo.py configs/grpo_tiny.py                    (or torchrun --nproc_per_node=2 grpo.py ...)
#   python -m tools.plots out/grpo_tiny                    # the reward curves: out/grpo_tiny/run.png
# What to expect (docs/stages.md's table): the machinery, not a gain. From this start the held-out reward
# moved within noise over 60 steps (sampled 0.234 -> 0.240, greedy 0.241 -> 0.259, lower in between);
# from the finished SFT model it fell. On a busy machine OMP_NUM_THREADS=1 runs it several times faster.
# Why sft_tiny's halfway checkpoint (step 150, kept by its ckpt_every): the finished model's held-out
# reward is too sharp for GRPO to move (docs/stages.md); halfway through SFT it still has a skill to gain.
init_from = "out/sft_tiny/step_000150"
out_dir = "out/grpo_tiny"
task = "arithmetic"
train_prompts = 4096
eval_prompts = 128          # the task holds ~54 questions back: all of them
batch_size = 256            # completions per step: 16 prompts x group_size
group_size = 16
micro_batch_size = 64
max_new_tokens = 8          # "71<|im_end|>" is 2 tokens
temperature = 0.7
loss_type = "dapo"
clip_high = 0.28            # DAPO's clip-higher
max_steps = 60              # docs/stages.md: the held-out reward of this run and two others
lr = 1e-4
warmup_steps = 5
schedule = "constant"
weight_decay = 0.0
log_every = 10
eval_every = 20
ckpt_every = 0              # only at the end
