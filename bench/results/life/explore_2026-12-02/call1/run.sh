#!/bin/bash
# exploratory life runs: pretrain -> 2 SFT tasks -> 4 GRPO variants in parallel; the GPU learning tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
L=$OUT/l; mkdir -p $L; R=/tmp/runs; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el start; nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 170 python3 pretrain.py configs/life.py --out_dir=$R/life --overwrite=True --progress=False > $L/pretrain.log 2>&1; el pretrain rc $?
tail -2 $L/pretrain.log
A="{'max_operand': 9, 'terms': 6, 'worked': True}"
AS="{'max_operand': 9, 'terms': 6, 'worked': True, 'check_steps': True}"
MS="{'check_steps': True}"
timeout 100 python3 sft.py configs/sft_life.py --init_from=$R/life --out_dir=$R/sft_a --task=arithmetic "--task_args=$A" --eval_tokens=64 --lr=3e-4 --overwrite=True --progress=False > $L/sft_a.log 2>&1 &
timeout 100 python3 sft.py configs/sft_life.py --init_from=$R/life --out_dir=$R/sft_m --lr=3e-4 --overwrite=True --progress=False > $L/sft_m.log 2>&1 &
wait; el sft done
grep -h "SFT done" $L/sft_*.log
G="configs/grpo_life.py --overwrite=True --progress=False --max_steps=250 --eval_every=50 --log_every=10"
timeout 290 python3 grpo.py $G --init_from=$R/sft_a --out_dir=$R/g1 --task=arithmetic "--task_args=$AS" --max_new_tokens=64 --lr=1e-5 > $L/g1.log 2>&1 &
timeout 290 python3 grpo.py $G --init_from=$R/sft_a --out_dir=$R/g2 --task=arithmetic "--task_args=$AS" --max_new_tokens=64 --lr=3e-6 > $L/g2.log 2>&1 &
timeout 290 python3 grpo.py $G --init_from=$R/sft_m --out_dir=$R/g3 --task=multistep "--task_args=$MS" --max_new_tokens=48 --lr=1e-5 > $L/g3.log 2>&1 &
timeout 290 python3 grpo.py $G --init_from=$R/sft_a --out_dir=$R/g4 --task=arithmetic "--task_args=$A" --max_new_tokens=64 --lr=1e-5 > $L/g4.log 2>&1 &
timeout 200 python3 -m pytest -q -x tests/test_learning.py -k gpu > $L/learning_gpu.log 2>&1 &
timeout 60 python3 dpo.py configs/dpo_life.py --init_from=$R/sft_a --out_dir=$R/dpo_a --task=arithmetic "--task_args=$A" --overwrite=True --progress=False > $L/dpo_a.log 2>&1; el dpo rc $?
grep -h "DPO done" $L/dpo_a.log
timeout 230 python3 grpo.py $G --init_from=$R/dpo_a --out_dir=$R/g5 --task=arithmetic "--task_args=$AS" --max_new_tokens=64 --lr=1e-5 > $L/g5.log 2>&1 &
wait; el grpo done
for f in $R/*/train_metrics.jsonl; do cp $f $L/$(basename $(dirname $f))_metrics.jsonl; done
grep -h "GRPO done\|step 250 | held\|Error" $L/g*.log; tail -3 $L/learning_gpu.log
(cd $OUT && tar czf life.tgz l && rm -rf l); el end
