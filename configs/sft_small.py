# Supervised fine-tuning of the small pretrained model (configs/small.py) on 2 GPUs.
#   torchrun --nproc_per_node=2 pretrain.py configs/small.py
#   torchrun --nproc_per_node=2 sft.py configs/sft_small.py                       # full fine-tuning
#   torchrun --nproc_per_node=2 sft.py configs/sft_small.py --lora_r=16 --lr=1e-3 --out_dir=out/sft_small_lora \
#       --merge=out/sft_small_merged                                             # LoRA, merged at the end
# Your own conversations instead of the generated task (alpaca / sharegpt / messages /
# prompt_completion, local .json/.jsonl/.parquet or hf:<name>): --chat_data=... --chat_format=...
# (the task's held-out accuracy is still printed unless --task="").
init_from = "out/small"
out_dir = "out/sft_small"
task = "arithmetic"
n_train = 200000
n_eval = 500
pack = True               # whole conversations side by side in rows (block-diagonal attention)
batch_size = 64            # rows of 1025 tokens: ~2,500 conversations per step
micro_batch_size = 16
max_steps = 500
lr = 5e-5                  # full fine-tuning; LoRA takes ~1e-3 (set with lora_r)
warmup_steps = 25
schedule = "cosine"
weight_decay = 0.0
compile = True
lora_alpha = 32.0          # with --lora_r=16: scale alpha / r = 2
log_every = 10
ckpt_every = 250
