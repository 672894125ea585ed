"""rewards.py: strict and lenient accuracy, the answer-format reward, and rewards by name and by file.

Proves, on hand-made completions whose scores are worked out by hand: lenient accuracy finds the
answer anywhere (a final-answer marker, else the last number) while strict accepts it only in the
item's asked format ('####' last line, \\boxed{}, <think>/<answer> tags) and is None where none is
asked; from_spec builds weighted sums of built-in rewards and of a user's function loaded from a file
(its columns arrive as keywords), and each wrong setting (unknown name, bad weight, missing file,
missing function, a function without **columns, a syntax error) is one UserError line naming it.
"""
import re

import pytest

from config import UserError
from posttrain import rewards

P = [{"role": "user", "content": "q"}]
CASES = [  # completion, gold, answer_format, strict, lenient
    ("12 + 35 = 47\n47 * 3 = 141\n#### 141", "141", "####", 1.0, 1.0),
    ("12 + 35 = 47\n47 * 3 = 141", "141", "####", 0.0, 1.0),          # right, not in the format
    ("#### 141\nI hope that helps.", "141", "####", 0.0, 1.0),       # '####' not on the last line
    ("#### 1,234.<|im_end|>junk", "1234", "####", 1.0, 1.0),          # cut at the end of turn; commas, a period
    ("47 * 3 = 140\n#### 140", "141", "####", 0.0, 0.0),
    ("so it is \\boxed{3/4}", "\\frac{3}{4}", "boxed", 1.0, 1.0),
    ("The answer is 0.75.", "\\frac{3}{4}", "boxed", 0.0, 1.0),
    ("<think>3+4</think> <answer>7</answer>", "7", "tags", 1.0, 1.0),
    ("<answer>7</answer>", "7", "tags", 0.0, 1.0),                    # no <think>: not the asked form
    ("it is 7", "7", "", None, 1.0),                                  # no format asked: no strict
    ("it is 7", None, "####", None, None),                            # no gold: neither applies
]


def test_strict_and_lenient_by_hand():
    completions, golds, fmts, strict, lenient = map(list, zip(*CASES))
    got = rewards.accuracy([P] * len(CASES), completions, answer=golds, answer_format=fmts)
    assert got == {"strict": strict, "lenient": lenient}
    assert rewards.strict_reward([P] * len(CASES), completions, answer=golds, answer_format=fmts) == strict
    assert rewards.lenient_reward([P] * len(CASES), completions, answer=golds, answer_format=fmts) == lenient
    assert rewards.strict_answer("a\n####  72 \n", "####") == "72" and rewards.strict_answer("#### \n", "####") is None
    assert rewards.last_number("from 3 to 1,234.5 and -7 ok") == "-7" and rewards.last_number("none") is None
    assert rewards.accuracy([P], ["#### 5"], solution=["steps\n#### 5"], answer_format=["####"]) == \
        {"strict": [1.0], "lenient": [1.0]}                          # a GSM8K solution column as gold
    with pytest.raises(ValueError, match="answer format 'xml' is not one of"):
        rewards.strict_answer("x", "xml")


def test_format_reward_follows_the_asked_format():
    completions = ["work\n#### 5", "#### 5\nmore", "\\boxed{x}", "<think>a</think><answer>b</answer>", "plain"]
    fmts = ["####", "####", "boxed", "", "tags"]
    assert rewards.answer_format_reward([P] * 5, completions, answer_format=fmts) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert rewards.answer_format_reward([P], ["<think></think><answer>1</answer>"]) == [1.0]  # no column: tags


def test_weighted_rewards_by_name():
    completions = ["47 * 3 = 141\n#### 141", "the answer is 141", "#### 140", "141"]
    cols = dict(answer=["141"] * 4, answer_format=["####"] * 4)
    r = rewards.from_spec("math,format:0.2")
    # math (a final-answer marker equal to the gold): 1, 1, 0, 0; format ('####' last line): 1, 0, 1, 0
    assert r([P] * 4, completions, **cols) == pytest.approx([1.2, 1.0, 0.2, 0.0])
    total, each = rewards.from_spec(" strict:2, lenient:-0.5 ,").score([P] * 4, completions, **cols)
    assert each == {"strict": [1.0, 0.0, 0.0, 0.0], "lenient": [1.0, 1.0, 0.0, 1.0]}
    assert total == pytest.approx([1.5, -0.5, 0.0, -0.5])
    task = rewards.from_spec("task,format:0.5", extra={"task": lambda p, c, **k: [float(len(x) > 5) for x in c]})
    assert task([P] * 4, completions, **cols) == pytest.approx([1.5, 1.0, 1.5, 0.0])
    assert [n for n, _, _ in task.parts] == ["task", "format"] and [w for _, w, _ in task.parts] == [1.0, 0.5]
    assert rewards.from_spec("math")([P], ["x"], answer=[None]) == [None]   # no part applies: None (TRL: NaN)


def test_reward_from_a_user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("import math\n\n"
                    "def close(prompts, completions, answer, **columns):\n"
                    "    return [1.0 / (1 + abs(float(c) - float(a))) for c, a in zip(completions, answer)]\n\n"
                    "def helper(x):\n    return x\n\n"
                    "def no_columns(prompts, completions):\n    return [0.0] * len(completions)\n")
    r = rewards.from_spec(f"{path}:close:0.5,math")
    # close: 1/(1+|c-a|) = 1, 1/2, 1/11, weighed 0.5; math: bare numbers carry no final-answer marker -> 0
    got = r([P] * 3, ["3", "4", "13"], answer=["3", "3", "3"])
    assert got == pytest.approx([0.5, 0.25, 0.5 / 11])
    assert rewards.from_spec(f"{path}:close")([P], ["3"], answer=["3"]) == [1.0]
    for spec, words in [
        ("maths", "unknown reward 'maths': choose one of math, strict, lenient, format, code or path/to/file.py:function"),
        ("math,format:lots", "reward weight 'lots' of 'format' is not a number"),
        ("format:inf", "reward weight 'inf' of 'format' must be finite"),
        ("", "reward='' names no reward"),
        ("math,format,math:2", "reward 'math' is named twice in 'math,format,math:2'"),
        (f"{tmp_path}/gone.py:f", f"reward file '{tmp_path}/gone.py' not found"),
        (f"{path}", "name the function in the file, as path/to/file.py:function"),
        (f"{path}:closer", f"reward file '{path}' has no function 'closer' (it defines: close, helper, no_columns)"),
        (f"{path}:no_columns:2", f"reward {path}:no_columns must be f(prompts, completions, **columns)"),
    ]:
        with pytest.raises(UserError, match=re.escape(words)):
            rewards.from_spec(spec)
    bad = tmp_path / "bad.py"
    bad.write_text("def f(prompts, completions, **k):\n    return [\n\nx = = 1\n")
    with pytest.raises(UserError, match=rf"reward file {bad}:\d+: "):
        rewards.from_spec(f"{bad}:f")
    short = rewards.from_spec("n", extra={"n": lambda p, c, **k: [1.0]})
    with pytest.raises(UserError, match="reward 'n' gave 1 values for 2 completions"):
        short([P] * 2, ["a", "b"])
