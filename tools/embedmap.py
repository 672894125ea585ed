"""Embedding maps: token embeddings and a prompt's hidden states per layer in 2-D, as a PNG.

    python -m tools.embedmap out/tiny --prompt="def add(a, b):" --out=map.png
    python -m tools.embedmap out/sft_tiny --neighbors="12,+,def,return" --k=8    # nearest tokens (cosine)
    python -m tools.embedmap /path/to/hf_folder --method=tsne --tokens=3000 --corpus=stdlib

The model is a run folder (its newest checkpoint), a checkpoint or an HF folder (sample.load).
Panels: the first `tokens` rows of the token embedding table (BPE ids, most frequent merges first),
coloured by what the token's text is (letters, digits, whitespace, code symbols, mixed, partial
UTF-8 bytes, special) and by its log frequency in `corpus` (any corpus.py source, first `docs`
documents); one panel per layer of the prompt's hidden states (the embedding output, then each
block's output), each token labelled; and, with `neighbors`, the k nearest tokens by cosine
similarity of the input embeddings (a chat model's template tokens included), also printed.

Coordinates: PCA (centred, the top two right singular vectors, each oriented so that its largest
|loading| is positive: the same picture on every run); `method="tsne"` (scikit-learn) or `"umap"`
(umap-learn) where that library is installed, imported lazily. matplotlib is imported lazily.
"""
import argparse
import json
import os
import string
import unicodedata

import torch

import config
import sample
from corpora import corpus

CLASSES = ("letter", "digit", "whitespace", "symbol", "mixed", "bytes", "special")
COLORS = {"letter": "tab:blue", "digit": "tab:red", "whitespace": "tab:gray", "symbol": "tab:green",
          "mixed": "tab:purple", "bytes": "tab:brown", "special": "black"}


def pca(x, k=2):
    """(n, d) -> ((n, k) coordinates, (k, d) components, (k,) explained variance ratio), in fp64."""
    x = x.double()
    xc = x - x.mean(0)
    _, s, vh = torch.linalg.svd(xc, full_matrices=False)
    vh = vh[:k]
    sign = vh.gather(1, vh.abs().argmax(1, keepdim=True)).sign()  # the largest |loading| positive
    vh = vh * sign
    var = s.square()
    return xc @ vh.T, vh, var[:k] / var.sum()


def project(x, method="pca", seed=0):
    """(n, d) -> (n, 2) coordinates by PCA, t-SNE or UMAP."""
    if method == "pca":
        return pca(x)[0]
    if method == "tsne":
        try:
            from sklearn.manifold import TSNE
        except ImportError:
            raise config.UserError("method='tsne' needs scikit-learn: pip install scikit-learn, or use --method=pca")
        n = x.shape[0]
        return torch.from_numpy(TSNE(2, perplexity=min(30.0, max(2.0, (n - 1) / 3)), random_state=seed,
                                     init="pca").fit_transform(x.double().numpy()))
    if method == "umap":
        try:
            import umap
        except ImportError:
            raise config.UserError("method='umap' needs umap-learn: pip install umap-learn, or use --method=pca")
        return torch.from_numpy(umap.UMAP(n_components=2, random_state=seed).fit_transform(x.double().numpy()))
    raise config.UserError(f"method={method!r}: choose pca, tsne or umap")


def token_class(raw, special=False):
    """A token's bytes -> one of CLASSES (its text stripped of whitespace decides, unless all space)."""
    if special:
        return "special"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes"
    if text.isspace() or not text:
        return "whitespace"
    t = text.strip()
    if all(c.isalpha() or c == "_" for c in t):
        return "letter"
    if t.isdigit():
        return "digit"
    if all(c in string.punctuation or unicodedata.category(c)[0] in "PS" for c in t):
        return "symbol"
    return "mixed"


def token_info(tok, ids):
    """[(text shown, class)] of token ids."""
    specials = set(getattr(tok, "special_tokens", {}).values())
    out = []
    for i, raw in zip(ids, tok.token_bytes(ids)):
        out.append((raw.decode("utf-8", errors="replace"), token_class(raw, i in specials)))
    return out


def frequencies(tok, source="stdlib", docs=200, n=None):
    """(n,) counts of each token id over the first `docs` documents of a corpus.py source."""
    counts = torch.zeros(n or tok.n_vocab, dtype=torch.long)
    texts = []
    for d in corpus.iter_documents(source):
        texts.append(d)
        if len(texts) >= docs:
            break
    for ids in tok.encode_batch(texts):
        ids = torch.tensor([i for i in ids if i < counts.numel()], dtype=torch.long)
        counts += torch.bincount(ids, minlength=counts.numel())
    return counts


@torch.no_grad()
def hidden_states(model, ids):
    """[(T, C)] of one prompt: the input of block 0 (embeddings), then each block's output."""
    seen, hooks = [], []
    hooks.append(model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0][0].float())))
    for b in model.blocks:
        hooks.append(b.register_forward_hook(lambda m, args, out: seen.append(out[0].float())))
    try:
        model(torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return seen


def embeddings(model):
    """(vocab_size, C) input embedding rows, fp32 on CPU (the padded rows left out)."""
    return model.tok_emb.weight.detach()[:model.cfg.vocab_size].float().cpu()


def neighbors(emb, ids, k=8):
    """{id: [(neighbour id, cosine)]}: the k most similar rows of emb to each id's row, itself excluded."""
    unit = emb / emb.norm(dim=1, keepdim=True).clamp(min=1e-12)
    sims = unit[ids] @ unit.T  # (len(ids), V)
    sims[torch.arange(len(ids)), torch.tensor(ids)] = -float("inf")
    top = sims.topk(k, dim=1)
    return {i: list(zip(top.indices[r].tolist(), top.values[r].tolist())) for r, i in enumerate(ids)}


def words_to_ids(tok, words):
    """Each word's first token (a chat model's special tokens by their text)."""
    out = []
    for w in words:
        special = getattr(tok, "special_tokens", {})
        ids = [special[w]] if w in special else tok.encode(w)
        if not ids:
            raise config.UserError(f"neighbors: {w!r} encodes to no token")
        out.append(ids[0])
    return out


def build(model, tok, prompt, tokens=4096, method="pca", freq=None, near=(), k=8, seed=0):
    """Everything the picture shows: {"tokens": {ids, coords, classes, counts}, "layers": [{coords,
    labels}], "neighbors": {word: [(text, cosine)]}}."""
    emb = embeddings(model)
    ids = list(range(min(tokens, emb.shape[0])))
    info = token_info(tok, ids)
    out = {"tokens": {"ids": ids, "coords": project(emb[ids], method, seed), "classes": [c for _, c in info],
                      "counts": None if freq is None else freq[ids]}}
    p = tok.encode(prompt) or [tok.eos_id]
    labels = [t for t, _ in token_info(tok, p)]
    states = hidden_states(model, p)
    out["layers"] = [{"coords": pca(h.cpu())[0] if h.shape[0] > 1 else torch.zeros(1, 2), "labels": labels,
                      "classes": [c for _, c in token_info(tok, p)]} for h in states]
    if near:
        nid = words_to_ids(tok, near)
        found = neighbors(emb, nid, k)
        out["neighbors"] = {w: [(token_info(tok, [j])[0][0], s) for j, s in found[i]] for w, i in zip(near, nid)}
    return out


def plot(data, out, title=""):
    """Write the PNG of build()'s data."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = data["layers"]
    top = 2 + ("neighbors" in data)
    cols = max(3, min(4, len(layers)))
    rows = 1 + -(-len(layers) // cols)
    fig = plt.figure(figsize=(4.2 * cols, 4 * rows))
    t = data["tokens"]
    xy = t["coords"].numpy()
    ax = fig.add_subplot(rows, cols, 1)
    counts = {c: t["classes"].count(c) for c in CLASSES}
    for c in sorted(CLASSES, key=lambda c: -counts[c]):  # the rarer classes drawn on top
        m = [i for i, k in enumerate(t["classes"]) if k == c]
        if m:
            ax.scatter(xy[m, 0], xy[m, 1], s=3, c=COLORS[c], label=f"{c} ({len(m)})")
    ax.legend(fontsize=6, markerscale=3)
    ax.set_title(f"token embeddings (first {len(t['ids'])} ids)", fontsize=9)
    if t["counts"] is not None:
        ax = fig.add_subplot(rows, cols, 2)
        sc = ax.scatter(xy[:, 0], xy[:, 1], s=3, c=torch.log10(t["counts"].double() + 1).numpy(), cmap="viridis")
        fig.colorbar(sc, ax=ax, label="log10(1 + count in corpus)")
        ax.set_title("token embeddings by corpus frequency", fontsize=9)
    if "neighbors" in data:
        ax = fig.add_subplot(rows, cols, top)
        ax.axis("off")
        lines = [f"{w!r}: " + ", ".join(f"{x!r} {s:.2f}" for x, s in nb[:6]) for w, nb in data["neighbors"].items()]
        ax.text(0, 1, "nearest tokens (cosine)\n" + "\n".join(lines), va="top", family="monospace", fontsize=6,
                wrap=True)
    for j, layer in enumerate(layers):
        ax = fig.add_subplot(rows, cols, cols + 1 + j)
        xy = layer["coords"].numpy()
        ax.plot(xy[:, 0], xy[:, 1], color="0.85", lw=0.8, zorder=0)  # the prompt's order
        ax.scatter(xy[:, 0], xy[:, 1], s=12, c=[COLORS[c] for c in layer["classes"]])
        if len(layer["labels"]) <= 64:
            for (x, y), s in zip(xy, layer["labels"]):
                ax.annotate(repr(s)[1:-1], (x, y), fontsize=6)
        ax.set_title("embeddings (block 0 input)" if j == 0 else f"after block {j - 1}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run folder, checkpoint folder or HF model folder")
    p.add_argument("--prompt", default="def add(a, b):\n    return a + b\n")
    p.add_argument("--out", default="", help="PNG path (default <model>/embedmap.png)")
    p.add_argument("--method", default="pca", help="pca | tsne (scikit-learn) | umap (umap-learn): the token map")
    p.add_argument("--tokens", type=int, default=4096, help="how many token ids (from 0) the map shows")
    p.add_argument("--corpus", default="stdlib", help="corpus.py source for token frequencies ('' : none)")
    p.add_argument("--docs", type=int, default=200, help="documents of the corpus counted")
    p.add_argument("--neighbors", default="", help="comma-separated words: their nearest tokens")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    try:
        model, tok, _ = sample.load(a.model, a.device)
        freq = frequencies(tok, a.corpus, a.docs, model.cfg.vocab_size) if a.corpus else None
        near = [w for w in a.neighbors.split(",") if w]
        data = build(model, tok, a.prompt, a.tokens, a.method, freq, near, a.k)
        out = a.out or os.path.join(a.model, "embedmap.png")
        plot(data, out, title=f"{a.model} ({a.method})")
    except (config.UserError, FileNotFoundError, ValueError) as e:
        p.error(str(e))
    for w, nb in data.get("neighbors", {}).items():
        print(f"{w!r}: " + json.dumps([[x, round(s, 4)] for x, s in nb], ensure_ascii=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
