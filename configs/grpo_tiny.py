# GRPO on the offline Arithmetic task (tasks.py) from the SFT'd tiny model: CPU, minutes.
#   python pretrain.py configs/tiny.py && python sft.py configs/sft_tiny.py     (or torchrun ... each)
#   python grpo.py configs/grpo_tiny.py                    (or torchrun --nproc_per_node=2 grpo.py ...)
# Without out/sft_tiny: --init_from=out/tiny (the bare pretrained model first has to stumble on the
# answer format: its reward stays near 0 much longer). Each step: 16 questions x 16 sampled answers,
# rewarded 1 for the right number; every eval_every steps the held-out questions (never trained on)
# are answered 16 times each at the sampling temperature and once greedily.
# A 1.3M-parameter model is touchy: with AdamW much above lr=5e-5 the held-out reward falls.
init_from = "out/sft_tiny"
out_dir = "out/grpo_tiny"
task = "arithmetic"
train_prompts = 4096
eval_prompts = 128          # the task holds ~60 questions back: all of them
batch_size = 256            # completions per step: 16 prompts x group_size
group_size = 16
micro_batch_size = 64
max_new_tokens = 8          # "71<|im_end|>" is 2 tokens
temperature = 0.7
loss_type = "dapo"
clip_high = 0.28            # DAPO's clip-higher
max_steps = 100
lr = 3e-5
warmup_steps = 5
schedule = "constant"
weight_decay = 0.0
log_every = 10
eval_every = 20
ckpt_every = 0              # only at the end
