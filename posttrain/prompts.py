"""Prompt data for RL: problems with reference answers -> items {"prompt": messages, every other column
as is}, whose columns reach the reward functions (TRL's f(prompts, completions, **columns)), and a
held-out split of them that is stated and never trained on.

    items, skipped = prompts.read(source, skip_bad=False, limit=0, instruction="")
    train, held, note = prompts.train_and_eval(source, eval_source="", eval_percent=5, seed=0)

A source is what chat data is (chat.iter_records): a .json / .jsonl / .parquet file, a folder of them,
or hf:<name>[:<config>][@<split>]. Formats (FORMATS), recognised from the first record:

    gsm8k   question / answer ending in '#### 72': prompt = the question, answer = '72' (the text after
            the last ####, thousands commas dropped), solution = the original answer (its worked steps)
    math    problem / solution with \\boxed{...}: prompt = the problem, answer = the last boxed content
            (a record's own non-empty 'answer' is kept), solution kept
    qa      question / answer without '####': prompt = the question, answer as is
    prompt  prompt (text or messages): chat.to_prompt, every other field as is ('answer', 'tests', ...)

Each item's answer_format column names the format its answer is asked in (rewards.ANSWER_FORMATS:
'####' for gsm8k, 'boxed' for math, a record's own answer_format, else ''): strict accuracy reads it.
instruction: text appended to the last user message ("auto": the answer format's own instruction).
A malformed record raises ChatDataError naming file:line, or with skip_bad is counted per reason.

The split: an item is held out when a hash of (seed, its prompt's text) falls under eval_percent, so
the same prompt always lands on the same side (duplicates never straddle) and a seed gives one split.
With an eval source, the training items whose prompt is also an eval prompt are left out (counted).
"""
import collections
import hashlib
import json

import chat
from posttrain import rewards, tasks

FORMATS = ("gsm8k", "math", "qa", "prompt")


def detect(record):
    """The format of a prompt record, from its fields (and, for question/answer, the '####')."""
    if not isinstance(record, dict):
        raise chat.BadRecord("not_object", f"a JSON {type(record).__name__}, not an object")
    if "prompt" in record:
        return "prompt"
    if {"problem", "solution"} <= set(record):
        return "math"
    if {"question", "answer"} <= set(record):
        return "gsm8k" if "####" in str(record["answer"]) else "qa"
    raise chat.BadRecord("unknown_format", f"fields {sorted(record)} match no prompt format (gsm8k: 'question' + "
                         "'answer' ending in '#### N'; math: 'problem' + 'solution' with \\boxed{}; 'prompt' with "
                         "any other columns): rename them")


def user(text):
    return [{"role": "user", "content": text}]


def text_of(record, field):
    value = record.get(field)
    if not isinstance(value, str) or not value.strip():
        raise chat.BadRecord("missing_field" if value is None else "not_text",
                             f"field {field!r} is {'missing' if value is None else 'empty or not text'} "
                             f"(fields: {sorted(record)})")
    return value


def hash_answer(text):
    """The text after the last '####' of a GSM8K answer (its first line), thousands commas dropped."""
    return text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip().replace(",", "")


def to_item(record, fmt, instruction=""):
    """One record of format fmt -> an item {"prompt": messages, "answer": gold, answer_format, every other
    field}. Raises chat.BadRecord saying what is wrong (a missing field, no '####' / \\boxed{} answer)."""
    if not isinstance(record, dict):
        raise chat.BadRecord("not_object", f"a JSON {type(record).__name__}, not an object")
    if fmt == "prompt":
        item = chat.to_prompt(record)
        item.setdefault("answer_format", "")
    elif fmt in ("gsm8k", "qa"):
        question, answer = text_of(record, "question"), text_of(record, "answer")
        if fmt == "gsm8k":
            if "####" not in answer or not hash_answer(answer):
                raise chat.BadRecord("no_answer", "the answer has no '#### <answer>' line (a GSM8K record's "
                                     "answer ends with it)")
            item = {**record, "prompt": user(question), "answer": hash_answer(answer),
                    "solution": answer, "answer_format": "####"}
        else:
            item = {**record, "prompt": user(question), "answer_format": ""}
    elif fmt == "math":
        problem, solution = text_of(record, "problem"), text_of(record, "solution")
        own = record.get("answer")
        answer = own.strip() if isinstance(own, str) and own.strip() else rewards.boxed(solution)
        if not answer:
            raise chat.BadRecord("no_answer", "the solution has no \\boxed{...} answer (and the record no 'answer')")
        item = {**record, "prompt": user(problem), "answer": answer, "answer_format": "boxed"}
    else:
        raise ValueError(f"unknown prompt format {fmt!r} (one of {', '.join(FORMATS)})")
    if item["answer_format"] not in ("", *rewards.ANSWER_FORMATS):
        raise chat.BadRecord("unknown_answer_format", f"answer_format {item['answer_format']!r} is not one of "
                             f"{', '.join(rewards.ANSWER_FORMATS)} (or empty: none asked)")
    if instruction:
        asked = rewards.ANSWER_FORMATS.get(item["answer_format"], "") if instruction == "auto" else instruction
        if asked:
            last = max(i for i, m in enumerate(item["prompt"]) if m["role"] == "user")
            item["prompt"] = [dict(m, content=m["content"].rstrip() + "\n" + asked) if i == last else m
                              for i, m in enumerate(item["prompt"])]
    return item


def read(source, fmt="auto", *, skip_bad=False, limit=0, instruction=""):
    """(items, Counter of skipped records per reason) of a source. fmt "auto": from the first record
    (detect). A bad record raises chat.ChatDataError naming file:line unless skip_bad; limit: stop after
    that many good records; instruction: see the module docstring."""
    if fmt != "auto" and fmt not in FORMATS:
        raise chat.ChatDataError(f"prompt format {fmt!r} is not one of auto, {', '.join(FORMATS)}")
    if not isinstance(limit, int) or limit < 0:
        raise chat.ChatDataError(f"limit={limit!r} must be an integer >= 0 (0: all records)")
    bad, out = collections.Counter(), []
    for where, record in chat.iter_records(source, bad if skip_bad else None):
        try:
            if fmt == "auto":
                try:
                    fmt = detect(record)
                except chat.BadRecord as e:
                    raise chat.ChatDataError(f"{where}: {e}") from None
            out.append(to_item(record, fmt, instruction))
        except chat.BadRecord as e:
            if not skip_bad:
                raise chat.ChatDataError(f"{where}: {e} (skip_bad_records=True skips such records and counts "
                                         "them)") from None
            bad[e.kind] += 1
            continue
        if limit and len(out) == limit:
            break
    if not out:
        raise chat.ChatDataError(f"prompt data {source!r} holds no prompt" +
                                 (f": every record was malformed ({dict(bad)})" if bad else ": it is empty"))
    return out, bad


# ----------------------------------------------------------------------------- the held-out split

def key(item):
    """The text that identifies an item's prompt (its messages, as JSON)."""
    return json.dumps(item["prompt"], sort_keys=True, ensure_ascii=False)


def held_out(item, percent, seed=0):
    """Whether an item belongs to the held-out split: a hash of (seed, its prompt) under percent of 100."""
    h = hashlib.blake2b(f"{seed}\0{key(item)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % 1_000_000 < percent * 10_000


def split(items, percent, seed=0):
    """(train, held) of items by held_out: disjoint, the same for the same seed, duplicates on one side."""
    held = [held_out(it, percent, seed) for it in items]
    return [it for it, h in zip(items, held) if not h], [it for it, h in zip(items, held) if h]


def train_and_eval(source, eval_source="", eval_percent=5.0, seed=0, **read_kw):
    """(train items, held-out items, a line stating the split). Held out: eval_source's items when given
    (training items with one of their prompts left out), else eval_percent of source (split). read_kw:
    read()'s keywords (skip_bad, limit, instruction); skipped records are counted in the line."""
    if not 0 <= eval_percent < 100:
        raise chat.ChatDataError(f"eval_percent={eval_percent} must be in [0, 100)")
    items, bad = read(source, **read_kw)
    if eval_source:
        held, bad_eval = read(eval_source, **{**read_kw, "limit": 0})
        seen = {key(it) for it in held}
        train = [it for it in items if key(it) not in seen]
        note = (f"{len(train):,} train prompts from {source}, {len(held):,} held out from {eval_source}"
                + (f"; {len(items) - len(train):,} training records with a held-out prompt left out"
                   if len(train) < len(items) else ""))
        bad = bad + bad_eval
    else:
        train, held = split(items, eval_percent, seed)
        note = (f"{len(train):,} train / {len(held):,} held-out prompts from {source}: held out by a hash of "
                f"(seed {seed}, the prompt) under {eval_percent:g}%")
    if bad:
        note += f"; skipped records: {dict(sorted(bad.items()))}"
    if not train:
        raise chat.ChatDataError(f"no training prompt left in {source!r} after the held-out split: lower "
                                 "eval_percent or check eval_prompt_data")
    if not held and (eval_source or eval_percent):
        raise chat.ChatDataError(f"no held-out prompt from {eval_source or source!r} ({len(items)} records at "
                                 f"eval_percent={eval_percent:g}): raise eval_percent, or give eval_prompt_data")
    return train, held, note


def for_run(cfg):
    """What a GRPO run samples and scores -> (train items, held-out items, reward, accuracy_fn, note):
    prompt_data's items (the split as train_and_eval states it; reward "" = math) or the task's
    (tasks.get(task, task_args); reward "" = the task's own). reward: rewards.from_spec(cfg.reward);
    accuracy_fn(prompts, completions, **columns) -> {"strict": [...], "lenient": [...]}."""
    if cfg.prompt_data:
        train, held, note = train_and_eval(cfg.prompt_data, cfg.eval_prompt_data, cfg.eval_percent, cfg.seed,
                                           skip_bad=cfg.skip_bad_records, limit=cfg.chat_limit,
                                           instruction=cfg.prompt_instruction)
        return train, held[:cfg.eval_prompts], rewards.from_spec(cfg.reward or "math"), rewards.accuracy, note
    task = tasks.get(cfg.task, cfg.task_args)
    train, held = task.train(cfg.train_prompts, cfg.seed), task.test(cfg.eval_prompts, cfg.seed)
    note = f"{task.name}: {len(train):,} train prompts (drawn from the task's train split) / {len(held):,} held out"
    return train, held, rewards.from_spec(cfg.reward or "task", extra={"task": task.reward_fn()}), task.accuracy_fn(), note


def judge(reward, accuracy_fn, rows, texts):
    """The completions `texts` of items `rows` scored: (rewards, one per text, None where none applies;
    {key: [sum, count]} of what to log: each part of a weighted reward (rewards/<name>) and the strict /
    lenient accuracy (accuracy_<kind>), over the values that are not None)."""
    columns = {k: [it[k] for it in rows] for k in rows[0] if k != "prompt"}  # "answer", "tests", ...
    asked = [it["prompt"] for it in rows]
    total, parts = reward.score(asked, texts, **columns)
    judged = {**({f"rewards/{k}": v for k, v in parts.items()} if len(parts) > 1 else {}),
              **{f"accuracy_{k}": v for k, v in accuracy_fn(asked, texts, **columns).items()}}
    return total, {k: [sum(x for x in v if x is not None), sum(x is not None for x in v)] for k, v in judged.items()}
