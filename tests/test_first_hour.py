"""A new user's first hour (issue 32): eval on chat checkpoints, HF export of a chat model, results
files, and bad input that must read as one clear line. Offline, CPU, tiny models.

Proves:
- eval.py on a chat-tuned checkpoint (a ChatML tokenizer: ids past the base vocabulary) generates
  and decodes those ids: a model rigged to answer '<|im_start|>' then '7' then '<|im_end|>' gives
  exactly the text '<|im_start|>7' (the end-of-turn id stops the decoder and is not printed), and
  the CLI's gsm8k on that checkpoint equals gsm8k_scores of those completions;
- that model exported (hf.export_hf with its chat tokenizer) has generation_config eos_token_id
  [end of turn, EOS], and transformers' greedy generate stops right after <|im_end|>;
- eval.py never overwrites results: a second run with the default name writes <model>_2.json and
  leaves the first file as it was; --results naming an existing file is refused before evaluating.
"""
import json

import pytest
import torch

import chat
import checkpoint
import config
import eval as ev
import hf
import scoring
from model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = ["--tokenizer_vocab=512", "--vocab_size=512", "--block_size=64", "--n_layer=1", "--n_head=2", "--n_embd=32", "--device=cpu"]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def rigged_chat_checkpoint(out_dir):
    """An SFT-like checkpoint (chat keys in its config, vocabulary 512 + the two ChatML tokens) whose
    model is a bigram table: blocks add nothing, so the logits depend on the last token only. After
    any other token it says <|im_start|>, after that '7', after '7' <|im_end|> (and then it starts
    over). -> (tok, seven, model)."""
    cfg = config.load(SHAPE, extra=chat.CHAT_DEFAULTS)
    tok, _ = chat.setup(cfg)
    start, end, seven = tok.special_tokens["<|im_start|>"], tok.eot_id, tok.encode("7")[0]
    assert (start, end, cfg.vocab_size) == (512, 513, 514)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
            block.mlp.proj.weight.zero_()
        emb, head = model.tok_emb.weight, model.head.weight
        emb.zero_()
        emb[:, 0] = 1.0                          # any other token: direction 0
        emb[start] = 0.0
        emb[start, 1] = 1.0                      # <|im_start|>: direction 1
        emb[seven] = 0.0
        emb[seven, 2] = 1.0                      # '7': direction 2
        head.zero_()
        head[start, 0] = head[seven, 1] = head[end, 2] = 10.0
    checkpoint.save(str(out_dir), 1, model.state_dict(), None, cfg)
    return tok, seven, model


def test_eval_decodes_chat_tokens(tmp_path):
    tok, seven, _ = rigged_chat_checkpoint(tmp_path / "sft")
    gsm = tmp_path / "gsm.jsonl"
    write_jsonl(gsm, [{"question": f"What is {a} + 4?", "answer": f"#### {a + 4}"} for a in (3, 5)])
    out = tmp_path / "res.json"
    res = ev.main([str(tmp_path / "sft"), f"--tasks=gsm8k={gsm}", "--num_fewshot=0", "--max_new_tokens=6",
                   f"--results={out}", "--device=cpu"])
    cfg = ev.load_config([str(tmp_path / "sft"), "--device=cpu"])
    tok = ev.model_tokenizer(cfg)
    assert tok.eot_id == 513 and tok.decode([512, seven]) == "<|im_start|>7"
    run = ev.load_model(cfg, ev.parallel.init(cfg))
    texts = scoring.generate_texts(run, tok, ["Question: What is 3 + 4?\nAnswer:"] * 2, 6)
    assert texts == [["<|im_start|>7"]] * 2
    docs, contexts = ev.task_prompts("gsm8k", str(gsm), SimpleCfg())
    texts = scoring.generate_texts(run, tok, contexts, 6, stops=ev.GSM8K_STOPS)
    assert [t[0] for t in texts] == ["<|im_start|>7"] * 2
    assert res["gsm8k"] == scoring.gsm8k_scores([t[0] for t in texts], docs)[0]
    assert res["gsm8k"]["exact_match_flexible"] == 0.5  # '7' is 3 + 4, not 5 + 4


def test_exported_chat_model_stops_at_end_of_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok, seven, model = rigged_chat_checkpoint(tmp_path / "sft")
    hf.export_hf(model, str(tmp_path / "hf"), tokenizer=tok)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eot_id, tok.eos_id] == [513, 511]  # [end of turn, EOS], as Qwen2's
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = torch.tensor([tok.encode("What is 3 + 4?")])
    out = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_id)
    assert out[0, prompt.shape[1]:].tolist() == [512, seven, 513]  # stopped at <|im_end|>


class SimpleCfg:
    limit, num_fewshot, fewshot_seed = 0, 0, 1234


def test_eval_never_overwrites_results(tmp_path, monkeypatch):
    rigged_chat_checkpoint(tmp_path / "sft")
    gsm = tmp_path / "gsm.jsonl"
    write_jsonl(gsm, [{"question": "What is 3 + 4?", "answer": "#### 7"}])
    monkeypatch.chdir(tmp_path)  # the default results folder is ./out/eval
    args = [str(tmp_path / "sft"), f"--tasks=gsm8k={gsm}", "--num_fewshot=0", "--max_new_tokens=4", "--device=cpu"]
    ev.main(args)
    first = sorted((tmp_path / "out" / "eval").iterdir())
    assert len(first) == 1 and first[0].name.endswith("_sft_step_000001.json")
    before = first[0].read_text()
    ev.main(args + ["--limit=1", "--temperature=0.5"])
    second = sorted((tmp_path / "out" / "eval").iterdir())
    assert [p.name for p in second] == [first[0].name, first[0].name[:-5] + "_2.json"]
    assert first[0].read_text() == before
    assert json.loads(second[1].read_text())["settings"]["temperature"] == 0.5
    with pytest.raises(scoring.EvalError, match=r"--results=.*_step_000001.json exists: eval.py never overwrites"):
        ev.main(args + [f"--results={first[0]}"])
    assert first[0].read_text() == before
