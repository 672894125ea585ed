# issue 56 on an H200: the race at nanoGPT's default 150M tokens, ingot at 3 seeds, the 24 GiB row, then one
# ablation per call of bench/speedrun.py (each call's report holds every row so far). Env: TINY, ABL.
R=${R:-/tmp/ing}; cd $R/repo || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
T=""; [ -n "$TINY" ] && T="--tiny"
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.log 2>&1
NG="$T --goal=${GOAL:-16} --nanogpt=$R/repo/nanogpt_3adf61e --out=$R/speedrun --results=$R/speedrun_results"
echo "start $(date -u +%T)"
python bench/speedrun.py $NG --rows=nanogpt,ingot --seeds=3 > $R/race.log 2>&1; echo "race rc=$? $(date -u +%T)"
python bench/speedrun.py $NG --rows=ingot --seeds=3 --cap_gib=24 > $R/cap.log 2>&1; echo "cap rc=$? $(date -u +%T)"
done=""
for a in ${ABL:-muon relu2 untied_head logit_softcap value_embeds unet_skips fp8_head qk_norm rope rmsnorm wsd bf16_residual compile}; do
  done="$done${done:+,}$a"  # cumulative: the rows already run are reused, so each report holds every row so far
  python bench/speedrun.py $NG --rows=ingot --seeds=3 --cap_gib=24 --ablate=$done > $R/abl_$a.log 2>&1; echo "$a rc=$? $(date -u +%T)"
done
touch $R/all.done
