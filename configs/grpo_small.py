# GRPO on the offline Arithmetic task (posttrain/tasks.py) from the SFT'd small model (configs/sft_small.py), one GPU:
# each step 32 questions x 8 answers, rewarded 1 for the right number; every 20 steps the held-out
# questions (never trained on) are answered 8 times each and greedily.
#   torchrun --nproc_per_node=2 pretrain.py configs/small.py && torchrun --nproc_per_node=2 sft.py configs/sft_small.py
#   python grpo.py configs/grpo_small.py
#   python -m tools.plots out/grpo_small    # out/grpo_small/run.png: training, held-out sampled and greedy reward
# What to expect (docs/stages.md): 39 s on one H200; the SFT'd model already answers most questions,
# so the reward curves show the machinery more than a gain.
init_from, out_dir, task = "out/sft_small", "out/grpo_small", "arithmetic"
max_steps, eval_every, log_every, ckpt_every = 160, 20, 10, 0   # a checkpoint at the end only
batch_size, group_size = 256, 8   # completions per step: 32 prompts x 8 samples
micro_batch_size = 128      # short rows (~30 tokens): 2 micro-batches on 1 GPU, 1 per rank on 2
train_prompts, eval_prompts = 8192, 128   # the task holds ~54 questions back: all of them
max_new_tokens = 8          # "71<|im_end|>" is 2 tokens
temperature = 1.0
loss_type, clip_high = "dapo", 0.28   # DAPO's token-mean loss and clip-higher
lr = 5e-6                   # full fine-tuning of 124M parameters with AdamW
warmup_steps, schedule, weight_decay = 10, "constant", 0.0
compile = False             # prompt lengths vary per step: eager learning, captured (uncompiled) decode steps
