"""posttrain/families.py: the five task families GRPO's recipe is tuned and judged on.

Proves, for each of word_problems, long_arithmetic, strings, units and shortest_path:
- items worked by hand in this file (the question's numbers, the steps, the answer) are what the family
  generates, and the strict reward gives 1.0 to the right '#### <answer>' last line and 0.0 to a wrong
  answer, a malformed marker, an answer not on the last line or no marker (lenient accuracy still finds a
  right answer elsewhere);
- the worked solutions of 300 generated items are right when re-evaluated independently: each "x op y = z"
  line by Fraction arithmetic, the answer by Python's own arithmetic on the question (long_arithmetic: the
  column digits and carries / borrows, the partial products), Python's string operations (strings), a table
  of each unit in its dimension's smallest unit written here (units), networkx's Dijkstra (shortest_path,
  and every trace line is a road of the map from a town already reached);
- train and test never share a question, whatever the seeds (the hash split of tasks.held_out), test items
  are distinct, and both are deterministic from the seed;
- the problem space: space() >= 1e6 and the docstring states it; distinct drawn problems read as distinct
  questions; and 20,000 draws repeat fewer questions than a space of 1e6 would (a birthday bound on the
  space the draws actually cover);
- sft_examples render through the chat template with exactly the worked solution trained;
- sft.py configs/sft_tiny.py and grpo.py configs/grpo_tiny.py run a step with --task=<family> (a tiny
  random model), each reporting held-out accuracy on the family.
"""
import json
import re
from fractions import Fraction

import pytest

from posttrain import tasks

NAMES = ("word_problems", "long_arithmetic", "strings", "units", "shortest_path")

# (family, problem, the question or a part of it, the worked solution, the answer): worked by hand
HAND = [
    ("word_problems", ("shopping", ("Ana", "pencils", 3, 4, "book", 5, 200)), "Ana buys 3 pencils at $4 each",
     "3 * 4 = 12\n12 + 5 = 17\n200 - 17 = 183", "183"),
    ("word_problems", ("ages", ("Ben", 2, 3, 10, 5)), "Ben is 3 times as old as Dev. Dev is 10 years old",
     "3 * 10 = 30\n30 + 5 = 35\n10 + 5 = 15\n35 + 15 = 50", "50"),
    ("word_problems", ("sharing", ("Emma", "cookies", 4, 12, 3, 5)), "Emma has 45 cookies and gets 3 more",
     "45 + 3 = 48\n48 / 4 = 12\n12 - 5 = 7", "7"),
    ("long_arithmetic", ("+", 4827, 3695), "What is 4827 + 3695?",
     ("digits of 4827: 4 8 2 7\ndigits of 3695: 3 6 9 5\n7 + 5 + 0 = 12, write 2, carry 1\n"
      "2 + 9 + 1 = 12, write 2, carry 1\n8 + 6 + 1 = 15, write 5, carry 1\n4 + 3 + 1 = 8, write 8, carry 0\n"
      "digits of the answer: 8 5 2 2"), "8522"),
    ("long_arithmetic", ("+", 99999, 100), "What is 99999 + 100?",
     ("digits of 99999: 9 9 9 9 9\ndigits of 100: 1 0 0\n9 + 0 + 0 = 9, write 9, carry 0\n"
      "9 + 0 + 0 = 9, write 9, carry 0\n9 + 1 + 0 = 10, write 0, carry 1\n9 + 0 + 1 = 10, write 0, carry 1\n"
      "9 + 0 + 1 = 10, write 0, carry 1\ndigits of the answer: 1 0 0 0 9 9"), "100099"),
    ("long_arithmetic", ("-", 5002, 378), "What is 5002 - 378?",
     ("digits of 5002: 5 0 0 2\ndigits of 378: 3 7 8\n12 - 8 - 0 = 4, borrow 1\n10 - 7 - 1 = 2, borrow 1\n"
      "10 - 3 - 1 = 6, borrow 1\n5 - 0 - 1 = 4, borrow 0\ndigits of the answer: 4 6 2 4"), "4624"),
    ("long_arithmetic", ("*", 305, 47), "What is 305 * 47?",
     "digits of 305: 3 0 5\n300 * 47 = 14100\n5 * 47 = 235\n14100 + 235 = 14335",
     "14335"),
    ("strings", ("reverse", "planet", None), "Reverse the letters of 'planet'.", "p l a n e t\nt e n a l p", "tenalp"),
    ("strings", ("sort", "planet", None), "Sort the letters of 'planet' in alphabetical order.",
     "p l a n e t\na e l n p t", "aelnpt"),
    ("strings", ("count", "banana", "a"), "How many times does the letter 'a' appear in 'banana'?",
     "b a n a n a\npositions of a: 2 4 6", "3"),
    ("strings", ("count", "planet", "z"), "the letter 'z'", "p l a n e t\npositions of z: none", "0"),
    ("strings", ("nth", "planet", 4), "What is letter 4 of 'planet'?", "p l a n e t\n1 p, 2 l, 3 a, 4 n", "n"),
    ("units", ("convert", "length", 3, 1, 250), "Convert 2.5 kilometres to centimetres.",
     "2.5 * 1000 = 2500\n2500 * 100 = 250000", "250000"),
    ("units", ("convert", "time", 1, 2, 150), "Convert 90 minutes to hours.", "90 / 60 = 1.5", "1.5"),
    ("units", ("convert", "imperial", 3, 1, 100), "Convert 1 mile to feet.", "1 * 1760 = 1760\n1760 * 3 = 5280", "5280"),
    ("units", ("total", "length", 2, 25, 45), "A rope is 2.5 metres long and another is 45 centimetres long",
     "2.5 * 100 = 250\n250 + 45 = 295", "295"),
    ("shortest_path", ((("A", "B", 4), ("A", "C", 1), ("B", "D", 1), ("C", "D", 5)), "A", "D"),
     "A-B 4, A-C 1, B-D 1, C-D 5. What is the length of the shortest route from A to D?",
     "A-C: 0 + 1 = 1\nA-B: 0 + 4 = 4\nB-D: 4 + 1 = 5", "5"),
    ("shortest_path", ((("A", "B", 2), ("A", "C", 2), ("B", "D", 3), ("C", "D", 3)), "A", "D"), "from A to D",
     "A-B: 0 + 2 = 2\nA-C: 0 + 2 = 2\nB-D: 2 + 3 = 5", "5"),   # ties: the earlier letter first
]


@pytest.mark.parametrize("name, problem, question, solution, answer", HAND)
def test_hand_worked_items_and_the_strict_reward(name, problem, question, solution, answer):
    fam = tasks.get(name)
    it = fam.item(problem)
    assert question in it["prompt"][0]["content"] and it["answer"] == answer and it["answer_format"] == "####"
    assert it["solution"] == f"{solution}\n#### {answer}"
    wrong = "1" + answer if answer.isdigit() else answer[::-1] + "x"
    for text, reward in [(it["solution"], 1.0), (f"#### {answer}", 1.0), (f"{solution}\n#### {answer}<|im_end|>junk", 1.0),
                         (f"{solution}\n#### {wrong}", 0.0), (f"{solution}\n### {answer}", 0.0),
                         (f"{solution}\n#### {answer}\nso the answer is {answer}", 0.0), (solution, 0.0), ("", 0.0),
                         (f"{solution}\n#### {answer} {answer}", 0.0), (f"{solution}\n####", 0.0)]:
        assert fam.reward(text, it) == reward, text
    assert fam.accuracy(it["solution"], it) == (1.0, 1.0)
    assert fam.accuracy(f"so the answer is\n{answer}", it) == (0.0, 1.0)
    assert fam.accuracy(f"#### {wrong}", it) == (0.0, 0.0)
    if name == "strings" and answer.isalpha() and len(answer) > 1:
        assert fam.reward(f"#### {answer.upper()}", it) == 0.0 and fam.reward(f"#### {' '.join(answer)}", it) == 0.0
    if name == "units":  # numbers compared as numbers
        assert fam.reward(f"#### {answer}{'0' if '.' in answer else '.0'}", it) == 1.0
    batch = fam.reward_fn()([it["prompt"]] * 2, [it["solution"], f"#### {wrong}"], answer=[answer] * 2)
    assert batch == [1.0, 0.0]


def value(expr):
    """An arithmetic expression of decimals, + - * /, evaluated exactly (Fractions)."""
    return eval(re.sub(r"\d+(?:\.\d+)?", lambda m: f"Fraction('{m.group()}')", expr), {"Fraction": Fraction})


def check_lines(lines):
    """Every 'expr = z' line (before any comma) right by Fraction arithmetic; their results."""
    out = []
    for line in lines:
        m = re.fullmatch(r"([\d. +\-*/]+) = ([\d.]+)(?:,.*)?", line)
        if m:
            assert value(m.group(1)) == Fraction(m.group(2)), line
            out.append(Fraction(m.group(2)))
    return out


UNIT_SIZE = {  # each unit in its dimension's smallest unit, written out here
    "millimetres": 1, "centimetres": 10, "metres": 1000, "kilometres": 10 ** 6, "milligrams": 1, "grams": 1000,
    "kilograms": 10 ** 6, "tonnes": 10 ** 9, "seconds": 1, "minutes": 60, "hours": 3600, "days": 86400,
    "weeks": 604800, "millilitres": 1, "litres": 1000, "kilolitres": 10 ** 6, "inches": 1, "feet": 12, "yards": 36,
    "miles": 63360}
SINGULAR = {"millimetre": "millimetres", "centimetre": "centimetres", "metre": "metres", "kilometre": "kilometres",
            "milligram": "milligrams", "gram": "grams", "kilogram": "kilograms", "tonne": "tonnes", "second": "seconds",
            "minute": "minutes", "hour": "hours", "day": "days", "week": "weeks", "millilitre": "millilitres",
            "litre": "litres", "kilolitre": "kilolitres", "inch": "inches", "foot": "feet", "yard": "yards",
            "mile": "miles"}


def size(unit):
    return UNIT_SIZE[SINGULAR.get(unit, unit)]


def check_item(name, it):
    """One generated item's worked solution re-evaluated independently of the family's code."""
    q, answer = it["prompt"][0]["content"], it["answer"]
    *lines, last = it["solution"].split("\n")
    assert last == f"#### {answer}"
    results = check_lines(lines)
    if name == "word_problems":
        assert 2 <= len(lines) <= 4 and len(results) == len(lines) and results[-1] == Fraction(answer)
        assert all(r >= 0 and r.denominator == 1 for r in results)
    elif name == "long_arithmetic":
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", q).groups()
        assert int(answer) == eval(f"{a} {op} {b}")
        assert lines[0] == f"digits of {a}: {' '.join(a)}"  # each number spelled digit by digit first
        if op == "*":  # place values of a (highest first) times b, then their sum
            lines = lines[1:]
            places = [int(d) * 10 ** k for k, d in enumerate(reversed(a)) if d != "0"][::-1]
            assert [line.split(" * ")[0] for line in lines[:len(places)]] == [str(p) for p in places]
            assert sum(results[:len(places)]) == int(answer) and results[-1] == int(answer)
        else:
            assert lines[1] == f"digits of {b}: {' '.join(b)}"
            assert lines[-1] == f"digits of the answer: {' '.join(answer)}"
            lines = lines[2:-1]
            cols = [re.fullmatch(r"(\d+) [-+] (\d) [-+] (\d) = (\d+), (?:write (\d), )?(carry|borrow) (\d)", line).groups()
                    for line in lines]
            top, bottom = a[::-1], b[::-1]
            assert len(cols) == max(len(a), len(b))
            carry, digits = 0, ""
            for k, (x, y, c, z, w, _, out) in enumerate(cols):
                assert int(c) == carry and int(y) == int(bottom[k] if k < len(b) else 0)
                if op == "+":
                    assert int(x) == int(top[k] if k < len(a) else 0) and w == str(int(z) % 10)
                    assert int(out) == int(z) // 10
                    digits += w
                else:
                    assert int(x) == int(top[k]) + 10 * int(out) and 0 <= int(z) <= 9
                    digits += z
                carry = int(out)
            assert int(("1" if carry else "") + digits[::-1]) == int(answer)
    elif name == "strings":
        *letter, word = re.findall(r"'([a-z]+)'", q)
        assert lines[0] == " ".join(word)
        if q.startswith("Reverse"):
            assert answer == word[::-1] and lines[1] == " ".join(answer)
        elif q.startswith("Sort"):
            assert answer == "".join(sorted(word)) and lines[1] == " ".join(answer)
        elif q.startswith("How many"):
            assert answer == str(word.count(letter[0]))
        else:
            n = int(re.search(r"letter (\d+)", q).group(1))
            assert answer == word[n - 1] and lines[1].endswith(f"{n} {answer}")
    elif name == "units":
        m = re.fullmatch(r"Convert ([\d.]+) (\w+) to (\w+)\.", q)
        if m:
            want = Fraction(m.group(1)) * size(m.group(2)) / size(m.group(3))
            assert len(lines) in (1, 2)
        else:
            (a, big), (b, small) = re.findall(r"(\d[\d.]*) (\w+)", q)
            assert re.search(rf"How many {SINGULAR.get(small, small)} ", q)
            want = Fraction(a) * size(big) / size(small) + Fraction(b)
            assert len(lines) == 2
        assert Fraction(answer) == want == results[-1]
    else:
        nx = pytest.importorskip("networkx")
        roads = re.findall(r"([A-F])-([A-F]) (\d)", q.split(". What")[0])
        s, t = re.search(r"from ([A-F]) to ([A-F])\?", q).groups()
        g = nx.Graph()
        g.add_weighted_edges_from((u, v, int(w)) for u, v, w in roads)
        assert int(answer) == nx.dijkstra_path_length(g, s, t)
        reached = {s: 0}
        for line in lines:  # Dijkstra's trace: a road from a town already reached, distances never falling
            u, v, du, w, dv = re.fullmatch(r"([A-F])-([A-F]): (\d+) \+ (\d) = (\d+)", line).groups()
            assert g[u][v]["weight"] == int(w) and reached[u] == int(du) and v not in reached
            assert int(dv) == nx.dijkstra_path_length(g, s, v) >= max(reached.values())
            reached[v] = int(dv)
        assert lines[-1].split(":")[0].endswith(t)


@pytest.mark.parametrize("name", NAMES)
def test_worked_solutions_are_right(name):
    fam = tasks.get(name)
    items = fam.train(300, seed=5)
    assert len({it["prompt"][0]["content"] for it in items}) > 250
    for it in items:
        check_item(name, it)


@pytest.mark.parametrize("name", NAMES)
def test_split_is_disjoint_and_deterministic(name):
    fam = tasks.get(name)
    train, test = fam.train(3000, seed=1), fam.test(300, seed=2)
    q_train = {it["prompt"][0]["content"] for it in train}
    q_test = [it["prompt"][0]["content"] for it in test]
    assert len(set(q_test)) == 300 and not q_train & set(q_test)
    assert all(tasks.held_out(q, 10) for q in q_test) and not any(tasks.held_out(q, 10) for q in q_train)
    assert fam.test(300, seed=3) != test and fam.train(50, seed=1) == train[:50] != fam.train(50, seed=2)
    assert fam.test(20, seed=2) == test[:20]


@pytest.mark.parametrize("name", NAMES)
def test_problem_space_is_over_a_million(name):
    fam = tasks.get(name)
    assert fam.space() >= 10 ** 6 and f"{fam.space():,}" in " ".join(type(fam).__doc__.split())
    import random
    rng, n = random.Random(0), 20_000
    problems = [fam.draw(rng) for _ in range(n)]
    questions = [fam.solve(p)[0] for p in problems]
    assert len(set(problems)) == len(set(questions))  # distinct problems read differently
    repeats = n - len(set(questions))
    # draws from a space of S equally likely problems repeat about n^2 / 2S of them: S >= 1e6 allows 200
    assert repeats <= n * n / 2 / 10 ** 6, repeats


@pytest.mark.parametrize("name", NAMES)
def test_sft_examples_render_with_the_solution_trained(name):
    import chat
    import tokenizer
    fam = tasks.get(name)
    tok, template = tokenizer.get_tokenizer("cl100k_base", chat=True), chat.default_template()
    for conv, it in zip(fam.sft_examples(5, seed=3), fam.train(5, seed=3)):
        assert conv == it["prompt"] + [{"role": "assistant", "content": it["solution"]}]
        ids, mask = chat.encode(tok, template, conv)
        assert tok.decode([i for i, m in zip(ids, mask) if m]).strip() == it["solution"] + "<|im_end|>"


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory):
    """A tiny random model (cl100k truncated to 4,096 ids, rows of 256 tokens) in a run folder."""
    from types import SimpleNamespace

    import torch

    import checkpoint
    import config
    import sft
    from model import ModelConfig, Transformer
    root = tmp_path_factory.mktemp("families")
    cfg = SimpleNamespace(**{**config.defaults(sft.EXTRA), "device": "cpu", "tokenizer": "cl100k_base",
                             "tokenizer_vocab": 4096, "vocab_size": 4096, "n_layer": 1, "n_head": 2, "n_kv_head": 1,
                             "n_embd": 32, "block_size": 256})
    torch.manual_seed(0)
    checkpoint.save(str(root / "init"), 1, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg, run_id="init")
    return root


@pytest.mark.parametrize("name", NAMES)
def test_sft_and_grpo_run_a_step_on_each_family(tiny_init, name, capsys, one_thread):
    import grpo
    import sft
    root, common = tiny_init, ["--device=cpu", "--progress=False", "--max_steps=1", "--log_every=1"]
    sft.main(["configs/sft_tiny.py", f"--init_from={root}/init", f"--out_dir={root}/sft_{name}", f"--task={name}",
              "--n_train=64", "--n_eval=2", "--eval_tokens=4", "--batch_size=2", "--micro_batch_size=2",
              "--ckpt_every=0", *common])
    grpo.main(["configs/grpo_tiny.py", f"--init_from={root}/sft_{name}", f"--out_dir={root}/grpo_{name}",
               f"--task={name}", "--train_prompts=4", "--eval_prompts=2", "--batch_size=4", "--group_size=2",
               "--micro_batch_size=4", "--max_new_tokens=4", "--eval_every=1", *common])
    out = capsys.readouterr().out
    assert re.search(rf"held-out accuracy [0-9.]+% of 2 {name} items", out) and f"data: {name}: 4 train prompts" in out
    with open(root / f"grpo_{name}" / "train_metrics.jsonl") as f:
        rec = [json.loads(line) for line in f]
    assert [r["step"] for r in rec if "heldout_greedy" in r] == [0, 1] and any("reward" in r for r in rec)
