# issue 55, the tuning wave alone (the judged wave in the next session, with the picked variant as the default):
# pretrain, SFT word_problems + units, GRPO x 4 variants side by side for TMIN minutes each
R=${R:-/tmp/ing}; cd $R/repo || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
T=""; [ -n "$TINY" ] && T="--tiny"
MEM=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>/dev/null | tee -a $R/gpu.log | head -1 | awk -F', ' '{print $2}')
MB=64; [ -n "$MEM" ] && [ "$MEM" -lt 100000 ] && MB=32; [ -n "$TINY" ] && MB=16
V=${V:-"defaults:;lr1e5:--lr=1e-5;lr2e5:--lr=2e-5;lr2e5_refill:--lr=2e-5 --dynamic_sampling=True --refill_rounds=2"}
echo "start $(date -u +%T) mb=$MB tmin=${TMIN:-7}"
python bench/grpo_families.py $T --out=$R/fam --runs=$R/runs --jobs=8 --grpo_steps=${STEPS:-2000} --grpo=--micro_batch_size=$MB \
  --minutes=${TMIN:-7} --families=word_problems,units --variants="$V" > $R/fam.log 2>&1
echo "rc=$? $(date -u +%T)"
touch $R/all.done
