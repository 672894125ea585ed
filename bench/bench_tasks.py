"""How hard a task is for a model of a given size: fine-tune it briefly on the task's worked solutions
(tasks.py sft_examples), then on held-out problems report greedy accuracy (strict and lenient, the
task's accuracy()) and pass@k of k samples at temperature 1 (strict) — the numbers that say whether
GRPO has room to gain (a moderate pass@k over a low pass@1).

    OMP_NUM_THREADS=2 python bench/bench_tasks.py --task=multistep --steps=300          # CPU, the tiny shape
    python bench/bench_tasks.py --task=countdown --device=cuda --n_layer=12 --n_head=12 --n_embd=768 \\
        --vocab=32768 --steps=2000 --batch=64 --lr=1e-3
The model starts from random weights (no pretraining), tokenizer cl100k_base cut to --vocab, our ChatML
template; rows of --block tokens packed with whole conversations. Prints one JSON line per evaluation.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import chat  # noqa: E402
import generate  # noqa: E402
import tokenizer  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from posttrain import tasks  # noqa: E402


def evaluate(model, tok, template, task, items, k, max_new_tokens, seed):
    """(greedy strict, greedy lenient, pass@1 sampled, pass@k sampled) over items."""
    stops = [tok.eot_id]
    prompts = [chat.encode(tok, template, it["prompt"], add_generation_prompt=True)[0] for it in items]

    def texts(r):
        return [tok.decode([t for t in row[:n] if t != tok.eot_id])
                for row, n in zip(r.tokens[:, r.prompt_len:].tolist(), r.lengths.tolist())]
    greedy = texts(generate.decode(model, prompts, max_new_tokens, vocab=tok, temperature=0.0, stop_tokens=stops, pad_id=0))
    acc = [task.accuracy(c, it) for c, it in zip(greedy, items)]
    sampled = texts(generate.decode(model, prompts, max_new_tokens, vocab=tok, n=k, temperature=1.0, stop_tokens=stops,
                                    pad_id=0, seed=seed))
    hits = [[task.reward(sampled[i * k + j], it) for j in range(k)] for i, it in enumerate(items)]
    return (sum(s for s, _ in acc) / len(items), sum(v for _, v in acc) / len(items),
            sum(sum(h) for h in hits) / (len(items) * k), sum(max(h) for h in hits) / len(items), greedy[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="multistep")
    ap.add_argument("--task_args", default="{}", help="JSON: the task's settings, e.g. '{\"max_operand\": 999}'")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="packed rows per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n_train", type=int, default=20000)
    ap.add_argument("--n_eval", type=int, default=100)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    task = tasks.get(a.task, json.loads(a.task_args))
    template = chat.default_template()
    tok = tokenizer.get_tokenizer("cl100k_base", a.vocab).with_chat(template.special_tokens, template.eos)
    examples = [chat.encode(tok, template, conv) for conv in task.sft_examples(a.n_train, a.seed)]
    rows, dropped = chat.pack(examples, a.block)
    held = task.test(a.n_eval, a.seed)
    mc = ModelConfig(vocab_size=tok.n_vocab, block_size=a.block, n_layer=a.n_layer, n_head=a.n_head,
                     n_kv_head=max(1, a.n_head // 2), n_embd=a.n_embd, tie_embeddings=True)
    model = Transformer(mc).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(a.seed)
    print(json.dumps({"task": a.task, "task_args": json.loads(a.task_args), "params": sum(p.numel() for p in model.parameters()),
                      "rows": len(rows), "dropped": dict(dropped), "examples": len(examples),
                      "space": getattr(task, "size", None)}), flush=True)
    t0 = time.time()
    for step in range(1, a.steps + 1):
        lr = a.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / a.steps))  # warmup, cosine
        for group in opt.param_groups:
            group["lr"] = lr
        x, y, pos, mask = chat.batch([rows[i] for i in torch.randint(len(rows), (a.batch,), generator=g).tolist()],
                                     a.device)
        loss = model(x, y, pos=pos, attn_mask=mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.eval_every == 0 or step == a.steps:
            strict, lenient, pass1, passk, example = evaluate(model, tok, template, task, held, a.k, a.max_new_tokens,
                                                              a.seed)
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "greedy_strict": strict,
                              "greedy_lenient": lenient, "pass@1": pass1, f"pass@{a.k}": passk,
                              "seconds": round(time.time() - t0, 1), "example": example}), flush=True)


if __name__ == "__main__":
    main()
