# DPO of the SFT'd tiny model on the offline Arithmetic task (posttrain/tasks.py): the correct answer chosen,
# a plausible wrong one (off by one, off by ten, digits swapped) rejected; CPU, a few minutes.
#   python pretrain.py configs/tiny.py && python sft.py configs/sft_tiny.py
#   python dpo.py configs/dpo_tiny.py                    (or torchrun --nproc_per_node=2 ...)
#   python dpo.py configs/dpo_tiny.py --lora_r=8 --lr=1e-3 --out_dir=out/dpo_tiny_lora   (reference: adapters off)
# The model shape, tokenizer and chat template come from init_from. Held-out pairs (the task's test
# questions) are scored before the first step and every eval_every steps: eval_rewards/accuracies
# starts at 0 (policy == reference), eval_policy/accuracy is how often the model itself prefers the
# correct answer.
init_from = "out/sft_tiny"
out_dir = "out/dpo_tiny"
task = "arithmetic"
n_pairs = 2000             # pairs on the ~590 training questions (sampled with replacement)
eval_pairs = 200           # held-out pairs: the task keeps ~60 questions back
beta = 0.1
loss_type = "sigmoid"
batch_size = 32
micro_batch_size = 16
max_steps = 60
lr = 5e-5
warmup_steps = 10
schedule = "cosine"
weight_decay = 0.0
eval_every = 20
log_every = 10
ckpt_every = 30
