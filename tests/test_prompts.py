"""prompts.py: RL prompt data read into items, and its held-out split.

Proves: each format (GSM8K's question / answer with '#### 72', MATH's problem / solution with \\boxed{},
question / answer, prompt as text or messages) from .jsonl / .json / .parquet / a folder gives the items
written out by hand, with every other column kept; the gold answers they carry are rewarded by
rewards.math_reward as worked by hand on hand-written completions (a GSM8K '####' answer, a \\boxed{}
fraction); a malformed record names file:line (or is counted with skip_bad); the hash split is
disjoint, covers every item, is the same for a seed and keeps duplicates on one side; an eval file's
prompts are never trained on.
"""
import json

import pytest

import chat
from posttrain import prompts, rewards

U = lambda c: [{"role": "user", "content": c}]  # noqa: E731
GSM = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                    "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                  "altogether in April and May.\n#### 72"},
       {"question": "A shop sold 1,000 pens and 234 pencils. How many items?", "answer": "1000+234=1234\n#### 1,234"}]
MATH = [{"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1",
         "solution": "We have $\\frac{1}{2}+\\frac{1}{4} = \\frac{2}{4}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
        {"problem": "Solve $x^2 = 4$, $x > 0$.", "solution": "So $x = \\boxed{2}$.", "answer": " 2 "}]


def write(path, records):
    if str(path).endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif str(path).endswith(".json"):
        path.write_text(json.dumps(records))
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa
        pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def test_gsm8k_read_and_rewarded_by_hand(tmp_path):
    items, skipped = prompts.read(write(tmp_path / "gsm.jsonl", GSM))
    assert not skipped
    assert items == [{"prompt": U(GSM[0]["question"]), "question": GSM[0]["question"], "answer": "72",
                      "solution": GSM[0]["answer"], "answer_format": "####"},
                     {"prompt": U(GSM[1]["question"]), "question": GSM[1]["question"], "answer": "1234",
                      "solution": GSM[1]["answer"], "answer_format": "####"}]
    completions = ["24 in May, 48 + 24 = 72\n#### 72", "#### 1,234", "The answer is 72.", "#### 71", "72"]
    golds = [items[0]["answer"], items[1]["answer"], items[0]["answer"], items[0]["answer"], items[0]["answer"]]
    # by hand: '#### 72' -> 72 = 72; '#### 1,234' -> 1234 (commas) = 1234; 'answer is 72' -> 72; 71 != 72;
    # a bare '72' has no final-answer marker: math_reward finds no answer
    assert rewards.math_reward([U("q")] * 5, completions, answer=golds) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_read_and_rewarded_by_hand(tmp_path):
    items, _ = prompts.read(write(tmp_path / "math.json", MATH))
    assert items == [{**MATH[0], "prompt": U(MATH[0]["problem"]), "answer": "\\frac{3}{4}", "answer_format": "boxed"},
                     {**MATH[1], "prompt": U(MATH[1]["problem"]), "answer": "2", "answer_format": "boxed"}]
    completions = ["$\\frac12+\\frac14=\\boxed{0.75}$", "\\boxed{3/4}", "\\boxed{\\frac{4}{3}}", "x = \\boxed{2}"]
    golds = [items[0]["answer"]] * 3 + [items[1]["answer"]]
    # by hand: 0.75 = 3/4; 3/4 = 3/4; 4/3 != 3/4; 2 = 2 (numbers compared exactly, no math-verify needed)
    assert rewards.math_reward([U("q")] * 4, completions, answer=golds, timeout=5) == [1.0, 1.0, 0.0, 1.0]


def test_generic_qa_and_folder(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}]
    write(folder / "a.parquet", [{"prompt": "1+2?", "answer": "3", "tests": "assert f() == 3"}])
    write(folder / "b.jsonl", [{"prompt": msgs, "answer": "6", "answer_format": "boxed"}])
    items, _ = prompts.read(str(folder))
    assert items == [{"prompt": U("1+2?"), "answer": "3", "tests": "assert f() == 3", "answer_format": ""},
                     {"prompt": msgs, "answer": "6", "answer_format": "boxed"}]
    assert rewards.math_reward([it["prompt"] for it in items], ["so \\boxed{3}", "#### 7"],
                               answer=[it["answer"] for it in items]) == [1.0, 0.0]
    qa, _ = prompts.read(write(tmp_path / "qa.jsonl", [{"question": "Capital of France?", "answer": "Paris", "id": 7}]))
    assert qa == [{"prompt": U("Capital of France?"), "question": "Capital of France?", "answer": "Paris", "id": 7,
                   "answer_format": ""}]
    asked, _ = prompts.read(write(tmp_path / "g.jsonl", GSM[:1]), instruction="auto")
    assert asked[0]["prompt"] == U(GSM[0]["question"] + "\n" + rewards.ANSWER_FORMATS["####"])
    mine, _ = prompts.read(str(folder), instruction="Think.", limit=1)
    assert mine == [{**items[0], "prompt": U("1+2?\nThink.")}]


def test_malformed_records_name_file_and_line(tmp_path):
    rows = [GSM[0], {"question": "q", "answer": "no hash here"}, {"question": "q"}, GSM[1]]
    path = write(tmp_path / "g.jsonl", rows)
    with pytest.raises(chat.ChatDataError, match=r"g\.jsonl:2: the answer has no '#### <answer>' line.*skip_bad"):
        prompts.read(path)
    items, skipped = prompts.read(path, skip_bad=True)
    assert [it["answer"] for it in items] == ["72", "1234"] and skipped == {"no_answer": 1, "missing_field": 1}
    with pytest.raises(chat.ChatDataError, match=r"m\.json\[1\]: the solution has no \\boxed"):
        prompts.read(write(tmp_path / "m.json", [MATH[0], {"problem": "p", "solution": "it is 3"}]))
    with pytest.raises(chat.ChatDataError, match=r"x\.jsonl:1: fields \['text'\] match no prompt format"):
        prompts.read(write(tmp_path / "x.jsonl", [{"text": "hi"}]))
    with pytest.raises(chat.ChatDataError, match=r"f\.jsonl:1: answer_format 'latex' is not one of"):
        prompts.read(write(tmp_path / "f.jsonl", [{"prompt": "p", "answer_format": "latex"}]))
    with pytest.raises(chat.ChatDataError, match="not found"):
        prompts.read(str(tmp_path / "missing.jsonl"))
    with pytest.raises(chat.ChatDataError, match=r"every record was malformed \({'no_answer': 1}\)"):
        prompts.read(write(tmp_path / "bad.jsonl", [{"question": "q", "answer": "####"}]), skip_bad=True)


def test_split_is_disjoint_deterministic_and_keeps_duplicates_together(tmp_path):
    items = [{"prompt": U(f"What is {i} + {i % 7}?"), "answer": str(i + i % 7), "answer_format": ""}
             for i in range(2000)]
    items += items[:50]  # duplicates
    train, held = prompts.split(items, 10, seed=3)
    keys = lambda xs: {prompts.key(it) for it in xs}  # noqa: E731
    assert not keys(train) & keys(held) and len(train) + len(held) == len(items)
    assert 140 < len(held) < 270  # 10% of 2050: a binomial's 205 +- 5 sigma
    assert prompts.split(items, 10, seed=3) == (train, held) and prompts.split(items, 10, seed=4)[1] != held
    assert prompts.split(items, 0, seed=3) == (items, [])
    path = write(tmp_path / "all.jsonl", items)
    t, h, note = prompts.train_and_eval(path, eval_percent=10, seed=3)
    assert (t, h) == (train, held)
    assert note == f"{len(train):,} train / {len(held):,} held-out prompts from {path}: held out by a hash of (seed 3, " \
                   "the prompt) under 10%"
    ev = write(tmp_path / "eval.jsonl", items[:30])
    t, h, note = prompts.train_and_eval(path, ev)
    assert h == items[:30] and not keys(t) & keys(h) and len(t) == len(items) - 60  # 30, and their 30 duplicates
    assert note.endswith("; 60 training records with a held-out prompt left out")
    with pytest.raises(chat.ChatDataError, match="no held-out prompt .* raise eval_percent"):
        prompts.train_and_eval(write(tmp_path / "one.jsonl", items[:1]), eval_percent=1)
    with pytest.raises(chat.ChatDataError, match=r"eval_percent=100 must be in \[0, 100\)"):
        prompts.train_and_eval(path, eval_percent=100)
