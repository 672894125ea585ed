"""embedmap.py: the 2-D maps are the PCA of the vectors, the neighbours the most similar rows.

Proves: pca()'s coordinates and explained variance equal a hand PCA (numpy's eigendecomposition of
the covariance, each component oriented by the stated rule; negated data then gives the same
components and negated coordinates, whatever signs the SVD picked); neighbors() equals a brute-force cosine ranking;
hidden_states() holds the embedding output and every block's output (the last, final-normed,
equals the model's own hidden_states()); token classes of hand-picked tokens; frequencies() equal
a count of the encoded corpus; the CLI writes a PNG from one of our checkpoints and from an HF
folder, printing the neighbours; t-SNE runs where scikit-learn is installed; a bad method is refused.
"""
import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import train_cfg

import checkpoint
import hf
import tokenizer
from model import ModelConfig, Transformer
from tools import embedmap

TINY = dict(vocab_size=300, tokenizer_vocab=300, block_size=32, n_layer=2, n_head=4, n_embd=32)


def test_pca_equals_hand_pca():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=g, dtype=torch.float64) @ torch.randn(16, 16, generator=g, dtype=torch.float64)
    coords, comps, ratio = embedmap.pca(x)
    xc = x.numpy() - x.numpy().mean(0)
    w, v = np.linalg.eigh(xc.T @ xc)  # ascending eigenvalues
    v = v[:, ::-1][:, :2].T.copy()
    for r in range(2):  # orient: the largest |loading| positive
        v[r] *= np.sign(v[r][np.abs(v[r]).argmax()])
    np.testing.assert_allclose(comps.numpy(), v, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(coords.numpy(), xc @ v.T, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(ratio.numpy(), w[::-1][:2] / w.sum(), rtol=1e-8)
    neg_coords, neg_comps, _ = embedmap.pca(-x)  # the orientation rule, not the SVD, fixes the signs
    np.testing.assert_allclose(neg_comps.numpy(), comps.numpy(), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(neg_coords.numpy(), -coords.numpy(), rtol=1e-8, atol=1e-9)
    assert embedmap.project(x.float(), "pca").shape == (200, 2)


def test_neighbors_equal_brute_force():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(50, 8, generator=g)
    emb[7] = emb[3] * 2.5 + 1e-3  # a near-copy: the top neighbour of 3
    got = embedmap.neighbors(emb, [3, 10, 49], k=5)
    for i in (3, 10, 49):
        sims = [(F.cosine_similarity(emb[i], emb[j], dim=0).item(), j) for j in range(50) if j != i]
        best = sorted(sims, reverse=True)[:5]
        assert [j for j, _ in got[i]] == [j for _, j in best]
        assert [s for _, s in got[i]] == pytest.approx([s for s, _ in best], abs=1e-6)
    assert got[3][0][0] == 7


def test_hidden_states_and_classes():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(train_cfg(TINY))).eval()
    ids = [5, 17, 42, 99]
    hs = embedmap.hidden_states(model, ids)
    assert len(hs) == 3 and all(h.shape == (4, 32) for h in hs)
    torch.testing.assert_close(hs[0], model.tok_emb.weight[ids])  # RoPE: the block input is the embedding
    with torch.no_grad():
        final = model.hidden_states(torch.tensor([ids]))[0]
    torch.testing.assert_close(model.norm_f(hs[-1]), final)
    cls = embedmap.token_class
    assert [cls(b"abc"), cls(b" self"), cls(b" 12"), cls(b"\n    "), cls(b"):"), cls(b" x1"), cls(b"\xe2\x80"),
            cls(b"<|endoftext|>", special=True), cls(b"__")] == \
        ["letter", "letter", "digit", "whitespace", "symbol", "mixed", "bytes", "special", "letter"]


def test_frequencies_count_the_corpus(tmp_path):
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    texts = ["def f(x):\n    return x + 1\n", "print('hello world')\n", "a = [1, 2, 3]\n"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.py").write_text(t)
    got = embedmap.frequencies(tok, str(tmp_path), docs=10, n=300)
    want = collections.Counter(i for t in texts for i in tok.encode(t))
    assert got.sum().item() == sum(want.values())
    assert {i: c for i, c in enumerate(got.tolist()) if c} == dict(want)
    one = embedmap.frequencies(tok, str(tmp_path), docs=1, n=300).sum().item()  # the first document only
    assert one in {len(tok.encode(t)) for t in texts} and one < got.sum().item()


def test_cli_from_checkpoint_and_hf_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cfg = train_cfg(TINY, seq_len=16)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    checkpoint.save(str(tmp_path / "run"), 5, model.state_dict(), None, cfg)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text("def add(a, b):\n    return a + b\n" * 3)
    out = tmp_path / "map.png"
    embedmap.main([str(tmp_path / "run"), "--prompt=def add(a, b):", f"--out={out}", "--tokens=300",
                   f"--corpus={tmp_path / 'corpus'}", "--neighbors=def,a", "--k=4"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert printed.count("'def': ") == 1 and "wrote" in printed
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    hf.export_hf(model, str(tmp_path / "hf"), tokenizer=tok)
    out2 = tmp_path / "hf.png"
    embedmap.main([str(tmp_path / "hf"), f"--out={out2}", "--corpus="])
    assert out2.stat().st_size > 1000
    with pytest.raises(SystemExit):
        embedmap.main([str(tmp_path / "hf"), "--method=isomap", f"--out={out2}", "--corpus="])
    assert "choose pca, tsne or umap" in capsys.readouterr().err


def test_tsne_where_installed():
    pytest.importorskip("sklearn")
    x = torch.randn(40, 6)
    xy = embedmap.project(x, "tsne")
    assert xy.shape == (40, 2) and torch.isfinite(xy).all()
