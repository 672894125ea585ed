"""The host's work in a stage script's optimizer step, for one or more source trees: Python calls and aten ops.

    python bench/bench_trl.py make --shape=tiny --out=/tmp/mt                  # a model folder and data
    python bench/bench_ops.py --model=/tmp/mt --tree=. --tree=/tmp/old --stages=sft,dpo --json=ops.json

Each tree's stage script runs in a child process of its own, on CPU, with bench_stages.py's arguments
(DPO's pairs cut to the context as its SFT rows are),
and ten optimizer steps are counted (from the end of step 5 to the end of step 15, torch's global
optimizer-step hook): every Python function call (sys.setprofile) and every aten op dispatched (a
TorchDispatchMode). Both counts are exact and do not depend on the machine's load, so two trees compare
where throughput runs spread by several percent: the same ops and about the same calls per step are the
same step. Per stage and tree: calls and ops per step, and the ops whose counts differ from the first tree.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_stages  # noqa: E402

FIRST, LAST = 5, 15  # the counted steps: after step FIRST to the end of step LAST


def child(tree, stage, argv):
    """Run tree's stage script in this process, counting steps FIRST + 1 .. LAST; print the counts as JSON."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode
    sys.path.insert(0, tree)
    os.chdir(tree)
    calls, ops, seen = collections.Counter(), collections.Counter(), [0]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def profile(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_name] += 1

    mode = Ops()

    def after_step(optimizer, args, kwargs):
        seen[0] += 1
        if seen[0] == FIRST:
            mode.__enter__()
            sys.setprofile(profile)
        elif seen[0] == LAST:
            sys.setprofile(None)
            mode.__exit__(None, None, None)

    register_optimizer_step_post_hook(after_step)
    module = __import__(stage)
    module.main(argv)
    n = LAST - FIRST
    print(json.dumps({"calls": sum(calls.values()) / n, "ops": sum(ops.values()) / n,
                      "by_op": {k: v / n for k, v in ops.items()}}))


def dpo_data(model, folder):
    """The model folder's DPO pairs with each side cut as bench_stages.sft_data cuts them (a tiny shape's context)."""
    with open(os.path.join(model, "config.json")) as f:
        keep = 0.8 * json.load(f)["max_position_embeddings"] / (512 + 1535)
    path = os.path.join(folder, "dpo.jsonl")
    with open(os.path.join(model, "dpo.jsonl")) as f, open(path, "w") as out:
        for line in f:
            out.write(json.dumps({k: v[:int(len(v) * keep)] for k, v in json.loads(line).items()}) + "\n")
    return path


def run(tree, stage, model, out, extra, sft, prompts, pairs):
    args = [a.format(model=model, sft=sft, prompts=prompts) for a in bench_stages.STAGES[stage]] + extra
    args = [f"--chat_data={pairs}" if a.startswith("--chat_data=") and stage == "dpo" else a for a in args]
    args = [a for a in args if not a.startswith("--max_steps=")] + [f"--max_steps={LAST + 2}"]
    if stage.startswith("grpo") and not os.path.isfile(os.path.join(tree, "lifecycle.py")):
        args.remove("--reward_truncated=True")  # a tree from before that key
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, stage.split("_")[0], f"--init_from={model}",
           f"--out_dir={out}", "--progress=False", "--ckpt_every=0", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3], sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="bench/bench_trl.py make's folder (--shape=tiny)")
    p.add_argument("--tree", action="append", required=True, help="a source tree (repeat to compare)")
    p.add_argument("--stages", default="sft,dpo,grpo")
    p.add_argument("--extra", default="", help="more --key=value for every stage (space separated)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sft = bench_stages.sft_data(a.model, tmp)
        sys.path.insert(0, os.path.abspath(a.tree[0]))
        prompts, pairs = bench_stages.prompt_file(tmp), dpo_data(a.model, tmp)
        for stage in a.stages.split(","):
            first = None
            for i, tree in enumerate(a.tree):
                got = run(os.path.abspath(tree), stage, a.model, os.path.join(tmp, f"{stage}_{i}"), a.extra.split(),
                          sft, prompts, pairs)
                first = first or got
                if "by_op" in got and "by_op" in first:
                    names = set(got["by_op"]) | set(first["by_op"])
                    got["ops_differing"] = {k: [first["by_op"].get(k, 0), got["by_op"].get(k, 0)] for k in sorted(names)
                                            if first["by_op"].get(k, 0) != got["by_op"].get(k, 0)}
                results.append({"stage": stage, "tree": tree, **got})
                print(json.dumps({k: v for k, v in results[-1].items() if k != "by_op"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
