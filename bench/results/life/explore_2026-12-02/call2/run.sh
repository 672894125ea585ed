#!/bin/bash
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
L=$OUT/l; mkdir -p $L; R=/tmp/runs; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
ls $R/life >/dev/null || { timeout 170 python3 pretrain.py configs/life.py --out_dir=$R/life --overwrite=True --progress=False > $L/pretrain.log 2>&1; }
el have pretrain
B="{'max_operand': 29, 'terms': 4, 'worked': True}"; BS="{'max_operand': 29, 'terms': 4, 'worked': True, 'check_steps': True}"
C="{'max_operand': 19, 'terms': 5, 'worked': True}"; CS="{'max_operand': 19, 'terms': 5, 'worked': True, 'check_steps': True}"
A="{'max_operand': 9, 'terms': 6, 'worked': True}"; AS="{'max_operand': 9, 'terms': 6, 'worked': True, 'check_steps': True}"
S="configs/sft_life.py --init_from=$R/life --task=arithmetic --eval_tokens=64 --lr=3e-4 --overwrite=True --progress=False"
timeout 100 python3 sft.py $S --out_dir=$R/sft_b "--task_args=$B" > $L/sft_b.log 2>&1 &
timeout 100 python3 sft.py $S --out_dir=$R/sft_c "--task_args=$C" > $L/sft_c.log 2>&1 &
timeout 100 python3 sft.py $S --out_dir=$R/sft_a20 "--task_args=$A" --max_steps=20 --warmup_steps=5 > $L/sft_a20.log 2>&1 &
wait; el sft done; grep -h "SFT done" $L/sft_*.log
G="configs/grpo_life.py --overwrite=True --progress=False --max_steps=300 --eval_every=50 --log_every=10 --task=arithmetic --max_new_tokens=64"
timeout 280 python3 grpo.py $G --init_from=$R/sft_b --out_dir=$R/h1 "--task_args=$BS" --lr=1e-5 > $L/h1.log 2>&1 &
timeout 280 python3 grpo.py $G --init_from=$R/sft_b --out_dir=$R/h2 "--task_args=$BS" --lr=3e-5 > $L/h2.log 2>&1 &
timeout 280 python3 grpo.py $G --init_from=$R/sft_c --out_dir=$R/h3 "--task_args=$CS" --lr=1e-5 > $L/h3.log 2>&1 &
timeout 280 python3 grpo.py $G --init_from=$R/sft_c --out_dir=$R/h4 "--task_args=$CS" --lr=3e-5 > $L/h4.log 2>&1 &
timeout 280 python3 grpo.py $G --init_from=$R/sft_a20 --out_dir=$R/h5 "--task_args=$AS" --lr=1e-5 > $L/h5.log 2>&1 &
timeout 280 python3 grpo.py $G --init_from=$R/sft_a20 --out_dir=$R/h6 "--task_args=$AS" --lr=3e-5 > $L/h6.log 2>&1 &
wait; el grpo done
for f in $R/*/train_metrics.jsonl; do cp $f $L/$(basename $(dirname $f))_metrics.jsonl; done
grep -h "GRPO done\|Error" $L/h*.log
(cd $OUT && tar czf life2.tgz l && rm -rf l); el end
