"""The peer of sft.py, dpo.py and grpo.py: TRL's trainers on the same model folder and the same data.

    python bench/bench_trl.py make --out=/tmp/b1b --shape=1b               # random-init HF folder + data
    torchrun --nproc_per_node=2 bench/bench_trl.py sft --model=/tmp/b1b --lora_r=16 --batch=4 --json=...
    torchrun --nproc_per_node=2 bench/bench_trl.py dpo --model=/tmp/b1b --batch=2 --json=...
    python bench/bench_trl.py grpo --model=/tmp/b124m --prompts=8 --G=8 --new_tokens=256 --json=...

`make` writes what both sides read: one of our Transformers with random weights exported as an HF
folder (hf.export_hf: config.json, model.safetensors, the tokenizer as tokenizer.json), so ingot's
stage scripts load it with init_from=<folder> and TRL with from_pretrained(<folder>) — the same
weights, the same tokenizer — plus three local jsonl files cut from the standard library's source:
sft.jsonl (prompt, completion), dpo.jsonl (prompt, chosen, rejected), grpo.jsonl (prompt). Every
example has the same token length, so there is no padding to argue about and tokens/s counts the
same tokens on both sides: (prompt + completion) tokens per example x examples per step.

The TRL side times optimizer steps after --warmup steps (a TrainerCallback; the GPU synchronised at
each step end) and reports tokens/s (sft, dpo: both answers count for dpo) or steps/s and rollout
tokens/s (grpo), and the peak GPU memory of the busiest rank, as one JSON line (--json appends it).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA = dict(activation="swiglu", norm="rmsnorm", pos_emb="rope")
SHAPES = {  # bench_parallel.py's ~1B and bench.py's 124M LLaMA shapes, on a 50,304-token cl100k prefix
    "1b": dict(LLAMA, block_size=2048, n_layer=16, n_embd=2048, n_head=16, n_kv_head=8, ffn_hidden=8192),
    "124m": dict(LLAMA, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(LLAMA, block_size=256, n_layer=2, n_embd=64, n_head=4, n_kv_head=2),
}
VOCAB = {"1b": 50304, "124m": 50304, "tiny": 512}


def make(a):
    import hf
    import tokenizer
    from corpora import corpus
    from model import ModelConfig, Transformer
    tok = tokenizer.get_tokenizer("cl100k_base", VOCAB[a.shape])
    os.makedirs(a.out, exist_ok=True)
    if a.model_from:  # the same weights, other data: link the model files of an earlier `make`
        for f in os.listdir(a.model_from):
            if not f.endswith(".jsonl"):
                os.symlink(os.path.join(os.path.abspath(a.model_from), f), os.path.join(a.out, f))
    else:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=tok.n_vocab, **SHAPES[a.shape]))
        hf.export_hf(model, a.out, tokenizer=tok)
    # windows of exactly n tokens cut from the standard library's files, decoded to text; a window is
    # kept only when its text encodes back to the same n tokens (so both sides see n tokens)
    def windows(n):
        for doc in corpus.iter_documents("stdlib"):
            ids = tok.encode(doc)
            for i in range(0, len(ids) - n, n):
                text = tok.decode(ids[i:i + n])
                if len(tok.encode(text)) == n:
                    yield text

    P, C = a.prompt_tokens, a.completion_tokens
    pieces = windows(P)
    answers = windows(C)
    with open(os.path.join(a.out, "sft.jsonl"), "w") as f:
        for _ in range(a.n):
            f.write(json.dumps({"prompt": next(pieces), "completion": next(answers)}) + "\n")
    with open(os.path.join(a.out, "dpo.jsonl"), "w") as f:
        for _ in range(a.n):
            f.write(json.dumps({"prompt": next(pieces), "chosen": next(answers), "rejected": next(answers)}) + "\n")
    with open(os.path.join(a.out, "grpo.jsonl"), "w") as f:
        for _ in range(a.n):
            f.write(json.dumps({"prompt": next(pieces)}) + "\n")
    print(f"wrote {a.out}: {a.n} examples of {P} + {C} tokens")


class Clock:
    """A transformers TrainerCallback (built lazily) timing the steps after `warmup`."""

    def __new__(cls, warmup):
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.times = []

            def on_step_end(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())

            def seconds_per_step(self):
                t = self.times[warmup:]
                return (t[-1] - t[0]) / (len(t) - 1)
        return _Clock()


def report(a, row):
    gpu = torch.cuda.is_available()
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0, device="cuda" if gpu else "cpu")
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    row.update(peak_gib=round(peak.item(), 2), gpus=int(os.environ.get("WORLD_SIZE", 1)),
               device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__)
    if int(os.environ.get("RANK", 0)) == 0:
        line = json.dumps(row)
        print(line)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")


def lora_config(a):
    if not a.lora_r:
        return None
    from peft import LoraConfig
    return LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def common_args(a, **kw):
    return dict(output_dir=f"/tmp/trl_{a.cmd}", per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                max_steps=a.steps, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                logging_steps=10_000, save_strategy="no", report_to=[], bf16=torch.cuda.is_available(), seed=0,
                gradient_checkpointing=a.grad_checkpoint, dataloader_num_workers=0,
                # fp32 weights under bf16 autocast, as ours; a LoRA run keeps the frozen base in bf16 (as
                # ours with lora_base_dtype="bfloat16")
                model_init_kwargs={"dtype": torch.bfloat16 if a.lora_r and torch.cuda.is_available() else
                                   torch.float32, "attn_implementation": "sdpa"}, **kw)


def length(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def sft(a):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = load_dataset("json", data_files=os.path.join(a.model, "sft.jsonl"), split="train")
    n_tokens = length(tok, ds[0]["prompt"]) + length(tok, ds[0]["completion"]) + 1  # + EOS
    clock = Clock(a.warmup)
    cfg = SFTConfig(**common_args(a, max_length=n_tokens, packing=False, completion_only_loss=True))
    trainer = SFTTrainer(model=a.model, args=cfg, train_dataset=ds, processing_class=tok,
                         peft_config=lora_config(a), callbacks=[clock])
    train_and_report(a, trainer, clock, "trl-sft", n_tokens, lora_r=a.lora_r)


def train_and_report(a, trainer, clock, name, n_tokens, **extra):
    """Train, then report tokens/s of the timed steps (n_tokens per row, a.batch rows per rank)."""
    trainer.train()
    s, world = clock.seconds_per_step(), int(os.environ.get("WORLD_SIZE", 1))
    report(a, dict(run=name + ("-lora" if a.lora_r else ""), tokens_per_step=n_tokens * a.batch * world,
                   tok_s=round(n_tokens * a.batch * world / s), s_per_step=round(s, 4), **extra))


def dpo(a):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = load_dataset("json", data_files=os.path.join(a.model, "dpo.jsonl"), split="train")
    p, c = length(tok, ds[0]["prompt"]), length(tok, ds[0]["chosen"])
    n_tokens = 2 * (p + c + 1)  # chosen and rejected rows, each prompt + answer + EOS
    clock = Clock(a.warmup)
    cfg = DPOConfig(**common_args(a, max_length=p + c + 1, beta=0.1, loss_type=["sigmoid"],
                                  precompute_ref_log_probs=a.precompute_ref))
    trainer = DPOTrainer(model=a.model, args=cfg, train_dataset=ds, processing_class=tok,
                         peft_config=lora_config(a), callbacks=[clock])
    train_and_report(a, trainer, clock, "trl-dpo", n_tokens, precompute_ref=a.precompute_ref)


def grpo(a):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = load_dataset("json", data_files=os.path.join(a.model, "grpo.jsonl"), split="train")

    def reward_len(completions, **kw):  # cheap and deterministic: the reward is not what is timed
        return [float(len(c) % 7) for c in completions]
    clock = Clock(a.warmup)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rows = a.prompts * a.G  # completions per optimizer step over all ranks
    a.batch = rows // world  # one generation per optimizer step (steps_per_generation = 1)
    cfg = GRPOConfig(**common_args(a, num_generations=a.G, max_completion_length=a.new_tokens, temperature=1.0,
                                   top_k=50, beta=0.0, loss_type="dapo", num_iterations=1,
                                   generation_batch_size=rows // world, cache_implementation=a.cache,
                                   generation_kwargs={"min_new_tokens": a.new_tokens}),
                     )
    # bf16 weights: transformers' static cache is allocated in the weights' dtype and refuses the bf16
    # keys/values of an fp32 model under autocast
    cfg.model_init_kwargs = dict(cfg.model_init_kwargs or {}, dtype=torch.bfloat16)
    trainer = GRPOTrainer(model=a.model, args=cfg, train_dataset=ds, processing_class=tok, reward_funcs=reward_len,
                           callbacks=[clock])
    trainer.train()
    s = clock.seconds_per_step()
    report(a, dict(run=f"trl-grpo-{a.cache or 'dynamic'}", steps_s=round(1 / s, 4), s_per_step=round(s, 4),
                   rollout_tok_s=round(rows * a.new_tokens / s), prompts=a.prompts, G=a.G, new_tokens=a.new_tokens))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["make", "sft", "dpo", "grpo"])
    p.add_argument("--out", default="/tmp/b1b")
    p.add_argument("--shape", choices=list(SHAPES), default="1b")
    p.add_argument("--model_from", default="", help="make: link this folder's model instead of a new one")
    p.add_argument("--n", type=int, default=256, help="examples per jsonl file")
    p.add_argument("--prompt_tokens", type=int, default=512)
    p.add_argument("--completion_tokens", type=int, default=1535)
    p.add_argument("--model", default="/tmp/b1b")
    p.add_argument("--batch", type=int, default=4, help="sequences (dpo: pairs) per GPU per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lora_r", type=int, default=0)
    p.add_argument("--lora_alpha", type=float, default=32.0)
    p.add_argument("--grad_checkpoint", action="store_true")
    p.add_argument("--precompute_ref", action="store_true")
    p.add_argument("--prompts", type=int, default=8, help="grpo: prompts per step (all ranks)")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--cache", default="static", help="grpo: transformers cache_implementation ('' = dynamic)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    a.cache = a.cache or None
    {"make": make, "sft": sft, "dpo": dpo, "grpo": grpo}[a.cmd](a)


if __name__ == "__main__":
    main()
