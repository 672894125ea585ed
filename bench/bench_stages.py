"""The stage scripts' own throughput (SFT, DPO, GRPO), for one or more source trees in the same call.

    python bench/bench_trl.py make --shape=124m --out=/tmp/m124                # a model folder and data
    python bench/bench_stages.py --model=/tmp/m124 --tree=. --tree=/tmp/old --json=stages.json

Each stage script of each tree runs as its users run it (`python <tree>/sft.py ...`) on the same model
folder and data, the trees alternating (A B ... A B) for --rounds, and reports what it logs itself:
SFT tok_s (on the folder's DPO prompts and chosen answers) and DPO pairs_s, the median log interval after the first
(every interval in "intervals": the trees see the same batches, so intervals pair up), GRPO's median step time
(rollout + reward + learn; every step in "steps", its parts and mean completion length in "parts") and
rollout tokens/s over its steps after the first.
Comparing a tree with another one (a commit before a refactor) in one call is what the house issue's
"no throughput loss" asks for.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

STAGES = {
    "sft": ["--chat_data={sft}", "--task=", "--pack=False", "--batch_size=8", "--micro_batch_size=8",
            "--n_eval=0", "--lr=1e-5", "--warmup_steps=0", "--max_steps=24", "--log_every=8"],
    "dpo": ["--chat_data={model}/dpo.jsonl", "--batch_size=8", "--micro_batch_size=8", "--eval_every=0",
            "--lr=1e-6", "--warmup_steps=0", "--max_steps=24", "--log_every=8"],
    "grpo": ["--task=arithmetic", "--batch_size=64", "--group_size=8", "--micro_batch_size=16",
             "--max_new_tokens=128", "--top_k=50", "--eval_every=0", "--lr=1e-6", "--warmup_steps=0",
             "--max_steps=8", "--log_every=1", "--reward_truncated=True"],
}
# GRPO on a prompt file of the same problems (the task's as GSM8K-style records): the data path's cost
STAGES["grpo_file"] = ["--prompt_data={prompts}", "--eval_percent=5.0", "--task="] + [
    a for a in STAGES["grpo"] if not a.startswith("--task=")]


def sft_data(model, folder):
    """prompt / completion records from the model folder's DPO pairs (512 + ~1535 tokens): the same share of
    each side's text, so that a row's tokens are ~80% of the model's context (its max_position_embeddings)."""
    with open(os.path.join(model, "config.json")) as f:
        keep = 0.8 * json.load(f)["max_position_embeddings"] / (512 + 1535)
    path = os.path.join(folder, "sft.jsonl")
    with open(os.path.join(model, "dpo.jsonl")) as f, open(path, "w") as out:
        for line in f:
            p, c = (r := json.loads(line))["prompt"], r["chosen"]
            out.write(json.dumps({"prompt": p[:int(len(p) * keep)], "completion": c[:int(len(c) * keep)]}) + "\n")
    return path


def prompt_file(folder, n=4096, seed=1337):
    """The Arithmetic task's training problems as a GSM8K-style file (question / answer '#### N')."""
    from posttrain import tasks
    path = os.path.join(folder, "prompts.jsonl")
    with open(path, "w") as out:
        for it in tasks.get("arithmetic").train(n, seed):
            out.write(json.dumps({"question": it["prompt"][-1]["content"], "answer": f"#### {it['answer']}"}) + "\n")
    return path


def run(tree, stage, model, out, extra, sft, prompts):
    if stage == "grpo_file" and not os.path.isfile(os.path.join(tree, "prompts.py")):
        return {"skipped": "this tree has no prompt data path"}
    args = [a.format(model=model, sft=sft, prompts=prompts) for a in STAGES[stage]] + extra
    if stage.startswith("grpo") and not os.path.isfile(os.path.join(tree, "lifecycle.py")):
        args.remove("--reward_truncated=True")  # a tree from before that key (it kept truncated rewards)
    cmd = [sys.executable, os.path.join(tree, f"{stage.split('_')[0]}.py"), f"--init_from={model}", f"--out_dir={out}",
           "--progress=False", "--ckpt_every=0", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:]}
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [m for m in rows if "lr" in m]
    if stage in ("sft", "dpo"):  # the median log interval after the first (which holds the warm-up)
        key = "tok_s" if stage == "sft" else "pairs_s"
        every = [m[key] for m in rows[1:] or rows]
        return {key: statistics.median(every), "intervals": every}
    steps = [m["t_rollout"] + m["t_reward"] + m["t_learn"] for m in rows[1:]]
    return {"s_per_step": statistics.median(steps), "steps": steps,
            "rollout_tok_s": statistics.median(m["gen_tok_s"] for m in rows[1:]),
            "parts": {k: [m.get(k) for m in rows[1:]] for k in ("t_rollout", "t_reward", "t_learn", "len")}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="bench/bench_trl.py make's folder")
    p.add_argument("--tree", action="append", required=True, help="a source tree (repeat to compare)")
    p.add_argument("--stages", default="sft,dpo,grpo,grpo_file")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--extra", default="", help="more --key=value for every stage (space separated)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sft = sft_data(a.model, tmp)
        sys.path.insert(0, os.path.abspath(a.tree[0]))
        prompts = prompt_file(tmp)
        for k in range(a.rounds):
            for stage in a.stages.split(","):
                for i, tree in enumerate(a.tree):
                    got = run(os.path.abspath(tree), stage, a.model, os.path.join(tmp, f"{stage}_{i}_{k}"),
                              a.extra.split(), sft, prompts)
                    results.append({"stage": stage, "tree": tree, "round": k, **got})
                    print(json.dumps(results[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
