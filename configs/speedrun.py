# ingot's fastest recipe to a target loss on one GPU (issue 56): a GPT-2-small-class model on the offline `python`
# corpus, each technique a named, commented choice. bench/speedrun.py races it against nanoGPT's own train.py recipe
# to nanoGPT's final validation loss (`--ablate=<name>` switches the choice of that name off: its cost in time).
#   python pretrain.py configs/speedrun.py                                # alone (eval_every, no target)
#   python pretrain.py configs/speedrun.py --target_loss=3.3 --eval_every=2   # stop at a validation loss
#   python bench/speedrun.py --nanogpt=/path/to/nanoGPT                    # the race (bench/README.md)
# Measured on one H100 (7f952e8; BENCHMARKS.md, the GPT-2 section): nanoGPT's loss after 150M tokens in 0.094x its
# time and tokens at 3 seeds (ReLU², since dropped: GELU reached it in 0.088x); AdamW instead of Muon costs 1.44x.
out_dir = "out/speedrun"

# --- the race's data: nanoGPT reads the same token files, so nothing here may change the tokens
data = "python"            # the interpreter's stdlib + site-packages, offline (~1e8 tokens on the GPU machine:
                           # 102.8M at 32k ids, cleaned: bench/results/2026-12-01/NOTES.md)
tokenizer = "cl100k_base"  # cl100k's first 50,256 merges + EOS: GPT-2's vocabulary size, offline, ids < 65,536
tokenizer_vocab = 50257    # (nanoGPT's loader reads uint16 tokens: the vocabulary must stay below 65,536)
pad_vocab_multiple = 64    # 50,257 -> 50,304 rows, as nanoGPT pads GPT-2's

# --- the model: GPT-2 small's size (12 x 768, T 1024), modernised
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024          # the race scores both models on the same 1024-token windows: keep it
pos_emb = "rope"           # --ablate=rope: learned positions (GPT-2)
norm = "rmsnorm"           # --ablate=rmsnorm: LayerNorm (GPT-2)
activation = "gelu"        # GPT-2's. ReLU² (Primer, modded-nanogpt) did not pay in the 150M-token race: 30.4 s to L
                           # (3 seeds: 29.8-30.4) against GELU's 28.5 s (one seed), one H100, 7f952e8
bias = False
qk_norm = True             # RMSNorm on q and k per head: steadier at high learning rates. --ablate=qk_norm
tie_embeddings = False     # an untied head (modded-nanogpt). --ablate=untied_head: tied (GPT-2)
fp32_residual = False      # the residual stream in bf16: ~4% faster (BENCHMARKS.md). --ablate=bf16_residual
dropout = 0.0
logit_softcap = 15.0       # logits = c * tanh(z / c): bounded logits, steadier early (modded-nanogpt, Gemma 2).
                           # --ablate=logit_softcap
value_embeds = 3           # 3 token tables mixed into v of layers 0-2 and 9-11 (modded-nanogpt). --ablate=value_embeds
unet_skips = True          # block i's output, times a learned weight, joins block 11-i's input. --ablate=unet_skips
fp8_head = True            # the head's matmul in FP8 on a GPU that has it (compute capability >= 8.9), bf16
                           # elsewhere. --ablate=fp8_head

# --- the optimizer: Muon for the blocks' matrices, AdamW for embeddings, head and norms
optimizer = "muon"         # --ablate=muon: AdamW everywhere, at lr
muon_lr = 4e-3             # the hidden matrices (muon_scale "rms": an update of AdamW's size at the same lr); Muon at
                           # 2e-3 beat 1e-3 at 16k tokens a step (bench/results/2026-11-30/NOTES.md): a larger batch
                           # takes a larger lr. A first guess, untuned
lr = 2e-3                  # the AdamW groups: embeddings, the untied head, norms
weight_decay = 0.0         # a short run: no decay (modded-nanogpt's early records)
grad_clip = 1.0

# --- the schedule: warm up briefly, hold, then decay to 0 at the end (where the loss falls fastest)
batch_size = 256           # 256 x 1024 = 262k tokens a step: half nanoGPT's 0.5M, twice the steps for the tokens
micro_batch_size = 32      # 8 accumulation steps; a speed knob only (the plan, --gpu_memory=24, says what fits)
max_steps = 200            # 52M tokens: the schedule's length (target_loss stops it earlier); too short and the run
                           # ends above the target. The race sets it to 1/3 of nanoGPT's tokens (--ingot_share)
warmup_steps = 20
schedule = "wsd"           # warmup-stable-decay. --ablate=wsd: cosine
wsd_decay_frac = 0.4       # the last 40% of the steps decay linearly
min_lr_ratio = 0.0         # to 0

# --- speed
compile = True             # torch.compile the model (the fused cross-entropy kernel comes on any GPU: fused.py).
                           # --ablate=compile: eager
eval_every = 10            # the race evaluates often enough to time the target within 2% (bench/speedrun.py)
eval_batches = 16          # 16 x 32 windows = 524k held-out tokens, the same every time
ckpt_every = 0             # a checkpoint at the end (or at target_loss) only
log_every = 10
sample_tokens = 0
