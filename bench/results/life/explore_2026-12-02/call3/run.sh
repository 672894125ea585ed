#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
L=$OUT/l; mkdir -p $L; R=/tmp/runs; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 150 python3 pretrain.py configs/life.py --out_dir=$R/life --overwrite=True --progress=False > $L/pretrain.log 2>&1; el pretrain rc $?
A="{'max_operand': 9, 'terms': 6, 'worked': True}"; AS="{'max_operand': 9, 'terms': 6, 'worked': True, 'check_steps': True}"
C="{'max_operand': 19, 'terms': 5, 'worked': True}"; CS="{'max_operand': 19, 'terms': 5, 'worked': True, 'check_steps': True}"
S="configs/sft_life.py --init_from=$R/life --task=arithmetic --eval_tokens=64 --overwrite=True --progress=False"
timeout 110 python3 sft.py $S --out_dir=$R/sft_c3 "--task_args=$C" --lr=3e-4 --max_steps=300 --n_train=48000 --warmup_steps=20 > $L/sft_c3.log 2>&1 &
timeout 110 python3 sft.py $S --out_dir=$R/sft_c1 "--task_args=$C" --lr=3e-4 > $L/sft_c1.log 2>&1 &
timeout 110 python3 sft.py $S --out_dir=$R/sft_a1 "--task_args=$A" --lr=1e-4 > $L/sft_a1.log 2>&1 &
timeout 110 python3 sft.py $S --out_dir=$R/sft_a40 "--task_args=$A" --lr=3e-4 --max_steps=40 --warmup_steps=5 > $L/sft_a40.log 2>&1 &
wait; el sft done; grep -h "SFT done" $L/sft_*.log
G="configs/grpo_life.py --overwrite=True --progress=False --max_steps=300 --eval_every=50 --log_every=10 --task=arithmetic --max_new_tokens=64"
timeout 300 python3 grpo.py $G --init_from=$R/sft_c3 --out_dir=$R/v1 "--task_args=$CS" --lr=1e-5 > $L/v1.log 2>&1 &
timeout 300 python3 grpo.py $G --init_from=$R/sft_c3 --out_dir=$R/v2 "--task_args=$CS" --lr=1e-5 --temperature=0.7 > $L/v2.log 2>&1 &
timeout 300 python3 grpo.py $G --init_from=$R/sft_a1 --out_dir=$R/v3 "--task_args=$AS" --lr=1e-5 > $L/v3.log 2>&1 &
timeout 300 python3 grpo.py $G --init_from=$R/sft_a40 --out_dir=$R/v4 "--task_args=$AS" --lr=1e-5 > $L/v4.log 2>&1 &
timeout 300 python3 grpo.py $G --init_from=$R/sft_c1 --out_dir=$R/v5 "--task_args=$CS" --lr=3e-6 --temperature=0.7 > $L/v5.log 2>&1 &
timeout 300 python3 grpo.py $G --init_from=$R/sft_c3 --out_dir=$R/v6 "--task_args=$CS" --lr=1e-5 --batch_size=1024 --micro_batch_size=256 --max_steps=150 --eval_every=25 > $L/v6.log 2>&1 &
wait; el grpo done
for f in $R/*/train_metrics.jsonl; do cp $f $L/$(basename $(dirname $f))_metrics.jsonl; done
grep -h "GRPO done\|Error" $L/v*.log
(cd $OUT && tar czf life3.tgz l && rm -rf l); el end
