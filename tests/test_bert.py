"""bert.py against transformers' BERT and against hand-worked masking.

Proves, on CPU in fp32 with tiny models built here (vocabulary 99: padded rows):
- a BertForMaskedLM folder loads with logits <= 1e-4 of transformers' (token types, a padded
  row), the same MLM loss (mean, and per position with reduction "none") and the same gradients of
  every parameter after one backward (q/k/v fused; the looked-up [PAD] row's gradient zero, as
  HF's padding_idx); BertForSequenceClassification and BertForTokenClassification folders give the
  logits and losses of theirs;
- export_hf writes folders transformers loads (AutoModelForMaskedLM / ...SequenceClassification /
  ...TokenClassification) with the same logits, and bert.load_hf reads them back;
- mask_tokens, worked by hand: with rate 1 every non-special position is a target holding its own
  token and specials are never targets; with rate 0 nothing changes. Over 300,000 positions: the
  chosen share is the rate (0.15 and 0.4) within 5 standard deviations, specials never chosen, the
  chosen split 80 / 10 / 10 into [MASK] / a random id / unchanged (a random id equal to the token
  counts as unchanged: 0.1 + 0.1 / V), random ids uniform over the vocabulary (mean and every
  id's count), unchosen inputs untouched; a seeded generator repeats its draw;
- configs ingot cannot reproduce and bad settings raise naming the field.
"""
import pytest
import torch
import torch.nn.functional as F

from config import ConfigError
from encoders import bert
from fused import IGNORE

pytestmark = pytest.mark.usefixtures("one_thread")
V = 99
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             max_position_embeddings=64, initializer_range=0.1)
CLASSES = {"mlm": ("BertForMaskedLM", {}), "sequence": ("BertForSequenceClassification", {"num_labels": 3}),
           "token": ("BertForTokenClassification", {"num_labels": 5})}


def transformers_or_skip():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    return t


def build(head, folder):
    t = transformers_or_skip()
    cls, kw = CLASSES[head]
    torch.manual_seed(0)
    ref = getattr(t, cls)(t.BertConfig(**SHAPE, **kw)).eval()
    with torch.no_grad():  # biases and norms not at their zero / one init
        for n, p in ref.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
            elif "LayerNorm" in n:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(folder))
    return ref, str(folder)


@pytest.fixture(scope="module", params=list(CLASSES))
def head(request, tmp_path_factory):
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param)))


def batch(seed=0):
    """ids (2, 24) of real tokens (no [PAD] = 0), token types 0 then 1, the second row's last 5 padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (2, 24), generator=g)
    types = torch.zeros_like(x)
    types[:, 10:] = 1
    mask = torch.ones_like(x)
    mask[1, -5:] = 0
    x[1, -5:] = 0
    return x, types, mask


def max_diff(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


def targets_for(head, x, mask, seed=1):
    g = torch.Generator().manual_seed(seed)
    if head == "sequence":
        return torch.tensor([2, 0])
    if head == "token":
        y = torch.randint(0, 5, x.shape, generator=g)
    else:
        _, y = bert.mask_tokens(x, mask_id=3, vocab_size=V, rate=0.3, special_ids=[0], generator=g)
    return y.masked_fill(mask == 0, IGNORE)


def test_logits_loss_and_gradients_equal_transformers(head):
    name, ref, folder = head
    ours = bert.load_hf(folder)
    assert (ours.cfg.head, ours.cfg.pad_id, ours.cfg.padded_vocab) == (name, 0, 128)
    x, types, mask = batch()
    y = targets_for(name, x, mask)
    with torch.no_grad():
        expected = ref(x, token_type_ids=types, attention_mask=mask).logits
        got = ours(x, token_type=types, attn_mask=mask)
        max_diff(got, expected)
        if name != "sequence":
            none = ours(x, y, token_type=types, attn_mask=mask, reduction="none")
            ref_none = F.cross_entropy(expected.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
            max_diff(none, ref_none, 1e-5)
    ref_loss = ref(x, token_type_ids=types, attention_mask=mask, labels=y).loss
    loss = ours(x, y, token_type=types, attn_mask=mask)
    max_diff(loss, ref_loss, 1e-5)
    ref_loss.backward()
    loss.backward()
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        hf_grads = [theirs[h].grad for h in bert.hf_names(ours.cfg)[n]] if n in bert.hf_names(ours.cfg) else None
        if hf_grads is None:
            continue
        g = torch.cat(hf_grads)
        if n == "tok_emb.weight" and name != "mlm":  # looked up at the padding; (MLM: the tied decoder's)
            assert p.grad[0].abs().max() == 0, "the [PAD] row got a gradient"
        max_diff(p.grad[:g.shape[0]], g, 1e-5)


@torch.no_grad()
def test_export_round_trip(head, tmp_path):
    t = transformers_or_skip()
    name, ref, folder = head
    bert.export_hf(bert.load_hf(folder), str(tmp_path))
    auto = {"mlm": t.AutoModelForMaskedLM, "sequence": t.AutoModelForSequenceClassification,
            "token": t.AutoModelForTokenClassification}[name]
    back = auto.from_pretrained(str(tmp_path)).eval()
    x, types, mask = batch(2)
    expected = ref(x, token_type_ids=types, attention_mask=mask).logits
    max_diff(back(x, token_type_ids=types, attention_mask=mask).logits, expected)
    max_diff(bert.load_hf(str(tmp_path))(x, token_type=types, attn_mask=mask), expected)


# ----------------------------------------------------------------------------- masking

CLS, SEP, PAD, MASK = 1, 2, 0, 3
SPECIAL = [CLS, SEP, PAD]


def test_masking_by_hand():
    ids = torch.tensor([[CLS, 10, 11, 12, SEP, PAD, PAD], [CLS, 20, SEP, 21, 22, SEP, PAD]])
    inputs, targets = bert.mask_tokens(ids, mask_id=MASK, vocab_size=50, rate=1.0, special_ids=SPECIAL,
                                       generator=torch.Generator().manual_seed(0))
    I = IGNORE
    assert targets.tolist() == [[I, 10, 11, 12, I, I, I], [I, 20, I, 21, 22, I, I]]
    special = torch.isin(ids, torch.tensor(SPECIAL))
    assert torch.equal(inputs[special], ids[special])  # specials are never touched
    inputs, targets = bert.mask_tokens(ids, mask_id=MASK, vocab_size=50, rate=0.0, special_ids=SPECIAL)
    assert torch.equal(inputs, ids) and (targets == IGNORE).all()


@pytest.mark.parametrize("rate", [0.15, 0.4])
def test_masking_rates_over_many_draws(rate):
    Vm, n = 1000, 300_000
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, Vm, (300, 1000), generator=g)
    ids[:, 0], ids[:, -1], ids[::7, 500:] = CLS, SEP, PAD  # specials: 2 per row + the padded halves
    inputs, targets = bert.mask_tokens(ids, mask_id=MASK, vocab_size=Vm, rate=rate, special_ids=SPECIAL,
                                       generator=torch.Generator().manual_seed(1))
    special = torch.isin(ids, torch.tensor(SPECIAL))
    chosen = targets != IGNORE
    assert ids.numel() == n and not (chosen & special).any()
    assert torch.equal(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])

    def near(count, total, p, what):
        sd = (total * p * (1 - p)) ** 0.5
        assert abs(count - total * p) <= 5 * sd, f"{what}: {count} of {total}, expected {total * p:.0f} +- {5 * sd:.0f}"
    m = int((~special).sum())
    near(int(chosen.sum()), m, rate, "chosen")
    c = int(chosen.sum())
    masked = chosen & (inputs == MASK) & (ids != MASK)
    same = chosen & (inputs == ids)
    rand = chosen & (inputs != MASK) & (inputs != ids)
    near(int(masked.sum()), c, 0.8, "[MASK]")
    near(int(same.sum()), c, 0.1 + 0.1 / Vm, "unchanged")
    near(int(rand.sum()), c, 0.1 * (1 - 2 / Vm), "random")  # a random MASK or own token counts elsewhere
    drawn = inputs[rand].float()
    assert abs(drawn.mean().item() - (Vm - 1) / 2) < 5 * (Vm / 12 ** 0.5) / drawn.numel() ** 0.5
    counts = torch.bincount(inputs[rand], minlength=Vm).float()
    expect = drawn.numel() / Vm
    assert (counts - expect).abs().max() <= 6 * expect ** 0.5, "random ids are not uniform"
    again = bert.mask_tokens(ids, mask_id=MASK, vocab_size=Vm, rate=rate, special_ids=SPECIAL,
                             generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], targets)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("over, match", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"is_decoder": True}, "is_decoder"), ({"hidden_act": "swish"}, "hidden_act"),
    ({"architectures": ["BertForQuestionAnswering"]}, "BertForQuestionAnswering"),
    ({"model_type": "roberta"}, "model_type"),
])
def test_unsupported_hf_configs(over, match):
    hf = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": V, "hidden_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 37}
    with pytest.raises(ConfigError, match=match):
        bert.config_from_hf({**hf, **over})


@pytest.mark.parametrize("kw, match", [
    (dict(head="qa"), "head"), (dict(head="sequence", n_labels=1), "n_labels"),
    (dict(activation="swiglu"), "activation"), (dict(n_embd=30, n_head=4), "n_embd=30"),
])
def test_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        bert.BertConfig(**{**dict(vocab_size=V, n_layer=1, n_head=2, n_embd=16), **kw})


def test_rate_and_length_errors():
    with pytest.raises(ConfigError, match="rate"):
        bert.mask_tokens(torch.zeros(2, 3, dtype=torch.long), mask_id=3, vocab_size=9, rate=1.5)
    model = bert.Bert(bert.BertConfig(vocab_size=V, n_layer=1, n_head=2, n_embd=16, block_size=8))
    with pytest.raises(ConfigError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
