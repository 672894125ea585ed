#!/usr/bin/env bash
# A model's whole life in one script: pretrain -> SFT -> DPO -> GRPO -> evaluation, each stage starting
# from the last one's final checkpoint. Read it top to bottom: every line is a command you could type.
#
#   bash runs/life.sh            # one GPU: configs/small.py's shape on Countdown (~7 minutes on an H200)
#   bash runs/life.sh --tiny     # no GPU: the tiny model on the arithmetic task (~9 minutes on 2 CPU cores)
#   bash runs/life.sh --tiny --max_steps=2    # anything after it is added to every stage (a smoke test)
#
# Everything lands under out/life_small/ (out/life_tiny/ with --tiny): one folder per stage, each stage's
# metrics as JSON lines in it, the evaluation's results in out/life*/eval.json.
set -euo pipefail
cd "$(dirname "$0")/.."
size=life run=out/life_small  # (configs/life.py alone writes out/life)
if [ "${1:-}" = "--tiny" ]; then shift; size=tiny run=out/life_tiny; fi
more=("$@")                             # extra overrides for every stage

if [ "$size" = tiny ]; then
  pre=configs/tiny.py sft=configs/sft_tiny.py dpo=configs/dpo_tiny.py grpo=configs/grpo_tiny.py
  launch=(python)                       # one CPU process each (torchrun --nproc_per_node=2 works too)
  bpb_tokens=65536                      # held-out tokens scored: the default 1M takes a CPU minutes
else
  pre=configs/life.py sft=configs/sft_life.py dpo=configs/dpo_life.py grpo=configs/grpo_life.py
  launch=(python)                       # one GPU; on two: launch=(torchrun --nproc_per_node=2)
  bpb_tokens=1048576                    # eval.py's default
fi

# 1. Pretraining: next-token prediction on the Python files of this interpreter (offline), a sample at the end.
"${launch[@]}" pretrain.py "$pre" --out_dir="$run/pretrain" "${more[@]}"

# 2. SFT: the task's worked answers under a chat template, loss on the assistant's tokens only; held-out
#    accuracy (greedy answers to problems never trained on) before and after.
"${launch[@]}" sft.py "$sft" --init_from="$run/pretrain" --out_dir="$run/sft" "${more[@]}"

# 3. DPO: the worked answer preferred to a plausible wrong one; the reference is the SFT model.
"${launch[@]}" dpo.py "$dpo" --init_from="$run/sft" --out_dir="$run/dpo" "${more[@]}"

# 4. GRPO: G samples per problem from the fast decoder, rewarded by the task's own checker, group advantages.
"${launch[@]}" grpo.py "$grpo" --init_from="$run/dpo" --out_dir="$run/grpo" "${more[@]}"

# 5. Evaluation of the final model: bits per byte on held-out text (eval.py --help lists the other tasks).
python eval.py "$run/grpo" --tasks=bpb --bpb_tokens="$bpb_tokens" --results="$run/eval.json"

# 6. The report: each stage's held-out metric before -> after and its minutes (report.md), every curve (report.png).
python -m tools.plots --life "$run/pretrain" "$run/sft" "$run/dpo" "$run/grpo" --out="$run/report"
