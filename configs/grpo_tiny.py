# GRPO on the offline Arithmetic task (tasks.py) from the SFT'd tiny model: CPU, a few minutes.
#   python pretrain.py configs/tiny.py && python sft.py configs/sft_tiny.py     (or torchrun ... each)
#   python grpo.py configs/grpo_tiny.py                    (or torchrun --nproc_per_node=2 grpo.py ...)
# Without out/sft_tiny: --init_from=out/tiny (the bare pretrained model first has to stumble on the
# answer format, so its reward rises later). Each step: 8 questions x 8 sampled answers, rewarded 1
# for the right number; the held-out reward (greedy answers to questions training never sees) is
# printed every eval_every steps.
init_from = "out/sft_tiny"
out_dir = "out/grpo_tiny"
task = "arithmetic"
train_prompts = 4096
eval_prompts = 128          # the task holds ~60 questions back: all of them
batch_size = 64             # completions per step: 8 prompts x group_size
group_size = 8
micro_batch_size = 32
max_new_tokens = 8          # "71<|im_end|>" is 2-3 tokens
temperature = 1.0
loss_type = "dapo"
clip_high = 0.28            # DAPO's clip-higher
max_steps = 60
lr = 2e-4
warmup_steps = 5
schedule = "constant"
weight_decay = 0.0
log_every = 5
eval_every = 10
ckpt_every = 0              # only at the end
