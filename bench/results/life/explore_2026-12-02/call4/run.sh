#!/bin/bash
# the session's GPU work, run detached (setsid): untimed learning runs share the GPU first, then the timed rows alone
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=/tmp/runs; Z=/tmp/res; mkdir -p $R $Z/life $Z/arch $Z/mem $Z/fp16; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $Z/progress.log; }
el start; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $Z/gpu.txt
python3 -c "import torch; print(torch.__version__)" >> $Z/gpu.txt
# --- phase B: untimed, sharing the GPU
( timeout 600 python3 bench/alibi_extrapolation.py --shape=gpu --steps=1500 --json=$Z/arch/alibi.json > $Z/arch/alibi.log 2>&1; el alibi rc $? ) &
( S="configs/small.py --max_steps=300 --batch_size=64 --micro_batch_size=32 --warmup_steps=30 --eval_every=50 --ckpt_every=0 --progress=False --overwrite=True"
  timeout 300 python3 pretrain.py $S --dtype=bfloat16 --out_dir=$R/small_bf16 > $Z/fp16/bf16.log 2>&1; el bf16 rc $?
  timeout 300 python3 pretrain.py $S --dtype=float16 --out_dir=$R/small_fp16 > $Z/fp16/fp16.log 2>&1; el fp16 rc $?
  for d in bf16 fp16; do cp $R/small_$d/train_metrics.jsonl $Z/fp16/${d}_metrics.jsonl; done ) &
( L=$Z/life
  timeout 240 python3 pretrain.py configs/life.py --out_dir=$R/life --overwrite=True --progress=False > $L/pretrain.log 2>&1; el pretrain rc $?
  C="{'max_operand':19,'terms':5,'worked':True}"; CS="{'max_operand':19,'terms':5,'worked':True,'check_steps':True}"
  S="configs/sft_life.py --init_from=$R/life --task=arithmetic --eval_tokens=64 --overwrite=True --progress=False --task_args=$C --lr=3e-4 --warmup_steps=15"
  timeout 150 python3 sft.py $S --out_dir=$R/s140 --max_steps=140 --n_train=22400 > $L/sft_140.log 2>&1 &
  timeout 150 python3 sft.py $S --out_dir=$R/s180 --max_steps=180 --n_train=28800 > $L/sft_180.log 2>&1 &
  wait; el sft done
  G="configs/grpo_life.py --overwrite=True --progress=False --max_steps=300 --eval_every=50 --log_every=10 --task=arithmetic --max_new_tokens=64 --task_args=$CS"
  timeout 330 python3 grpo.py $G --init_from=$R/s140 --out_dir=$R/g1 --lr=1e-5 > $L/g1.log 2>&1 &
  timeout 330 python3 grpo.py $G --init_from=$R/s140 --out_dir=$R/g2 --lr=2e-5 > $L/g2.log 2>&1 &
  timeout 330 python3 grpo.py $G --init_from=$R/s140 --out_dir=$R/g3 --lr=1e-5 --beta=0.02 > $L/g3.log 2>&1 &
  timeout 330 python3 grpo.py $G --init_from=$R/s180 --out_dir=$R/g4 --lr=1e-5 > $L/g4.log 2>&1 &
  timeout 330 python3 grpo.py $G --init_from=$R/s180 --out_dir=$R/g5 --lr=2e-5 > $L/g5.log 2>&1 &
  wait; el grpo done
  for d in life s140 s180 g1 g2 g3 g4 g5; do cp $R/$d/train_metrics.jsonl $L/${d}_metrics.jsonl 2>/dev/null; done ) &
wait; el phase B done
# --- phase A: timed, alone on the GPU
timeout 420 python3 bench/compare_arch.py --shape=gpu --steps=1000 --png=$Z/arch/arch.png --json=$Z/arch/arch.json > $Z/arch/arch.log 2>&1; el compare rc $?
timeout 200 python3 bench/bench_encoders.py --json=$Z/arch/encoders.json > $Z/arch/encoders.log 2>&1; el encoders rc $?
for c in lora8b qlora8b full1b pretrain1b ladder hf8b hf1b; do
  timeout 420 python3 bench/bench_memory.py $c --cap_gib=24 --steps=3 --warmup=1 --json=$Z/mem/$c.json > $Z/mem/$c.log 2>&1; el mem $c rc $?
done
el all done; touch $Z/DONE
