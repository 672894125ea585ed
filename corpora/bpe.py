"""A tokenizer of your own: a byte-level BPE trained on a corpus with Hugging Face `tokenizers`.

    python -m corpora.bpe train SOURCE OUT --vocab=32768 [--held_out=0.01] [--max_docs=0] [--text_field=text]
    python -m corpora.bpe compare OUT SOURCE      # bytes per token against cl100k_base on SOURCE's documents
    python pretrain.py configs/tiny.py --tokenizer=OUT      # or python -m corpora.shards prepare ... --tokenizer=OUT

OUT gets tokenizer.json (a byte-level BPE: cl100k_base's split pattern, then GPT-2's byte-to-character
map; ids 0..vocab-2 the 256 bytes and the merges in the order learned, <|endoftext|> = vocab-1) and
tokenizer_config.json: what tokenizer.load_hf_tokenizer reads (so tokenizer.get_tokenizer(OUT), a
folder, gives the same ids through tiktoken) and what transformers' PreTrainedTokenizerFast
loads (AutoTokenizer.from_pretrained(OUT)): the HF export is the folder itself.

Held out: a document is kept out of training when BLAKE2b of its index falls below held_out (as
shards.is_val); train() reports the compression on those documents, ours and cl100k_base's, as
UTF-8 bytes per token (higher: fewer tokens for the same text), in OUT/compression.json.
The BPE model uses ignore_merges (a word that is one token is taken whole), as tiktoken does.
"""
import argparse
import json
import os
import re
import sys

import tokenizer
from corpora import corpus, shards

EOS = tokenizer.ENDOFTEXT


def split_pattern():
    """cl100k_base's pre-tokenizer regex as Oniguruma (tokenizers) reads it: 'x{1,3}+' -> 'x{1,3}'
    (tokenizer.save_tokenizer's rewrite: the same meaning, as that repetition never backtracks)."""
    return re.sub(r"(\{\d+(,\d*)?\})\+", r"\1", tokenizer.CL100K_PAT)


def train(source, out, vocab=32768, held_out=0.01, max_docs=0, text_field="text", verbose=True):
    """Train a byte-level BPE of `vocab` ids (EOS included) on the documents of `source` that are not
    held out; write OUT (module docstring) and return compare() on the held-out documents (None when
    none are held out)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    if not isinstance(vocab, int) or vocab < 258:
        raise corpus.DataError(f"vocab={vocab} must be an integer >= 258 (256 bytes, a merge and EOS)")
    if not 0 <= held_out < 1:
        raise corpus.DataError(f"held_out={held_out} must be in [0, 1)")
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=verbose, special_tokens=[])
    held = []

    def training_docs():
        for i, doc in enumerate(corpus.iter_documents(source, text_field)):
            if max_docs and i >= max_docs:
                break
            if shards.is_val(i, held_out):
                held.append(doc)
            else:
                yield doc
    tok.train_from_iterator(training_docs(), trainer)
    tok.add_special_tokens([EOS])  # after the merges: id vocab-1 when the corpus gave every merge
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    tokenizer.write_json(os.path.join(out, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30})
    n = tok.get_vocab_size()
    if verbose:
        print(f"bpe: {out}: {n:,} ids ({EOS} = {tok.token_to_id(EOS)})"
              + (f", fewer than vocab={vocab}: the corpus holds no more merges" if n < vocab else ""))
    if not held:
        return None
    report = compare(out, held, verbose=verbose)
    with open(os.path.join(out, "compression.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def bytes_per_token(tok, docs):
    """UTF-8 bytes per token of a tokenizer over documents: (bytes, tokens, ratio)."""
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(list(docs), num_threads=4))
    return n_bytes, n_tokens, n_bytes / max(n_tokens, 1)


def compare(folder, docs, reference="cl100k_base", verbose=True):
    """Bytes per token of the tokenizer in `folder` and of `reference` on docs (a list of texts or a
    corpus source)."""
    docs = list(corpus.iter_documents(docs) if isinstance(docs, str) else docs)
    ours, ref = tokenizer.get_tokenizer(folder), tokenizer.get_tokenizer(reference)
    report = {"documents": len(docs)}
    for name, tok in (("ours", ours), (reference, ref)):
        b, t, r = bytes_per_token(tok, docs)
        report[name] = dict(tokenizer=tok.name, n_vocab=tok.n_vocab, bytes=b, tokens=t, bytes_per_token=r)
    if verbose:
        print(f"bpe: on {len(docs):,} held-out documents ({report['ours']['bytes']:,} bytes): ours "
              f"{report['ours']['bytes_per_token']:.3f} bytes/token (n_vocab {ours.n_vocab:,}), {reference} "
              f"{report[reference]['bytes_per_token']:.3f} (n_vocab {ref.n_vocab:,})")
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pt = corpus.add_arguments(sub.add_parser("train", help="train a byte-level BPE on a corpus"))
    pt.add_argument("--vocab", type=int, default=32768, help="ids in all, EOS included")
    pt.add_argument("--held_out", type=float, default=0.01, help="share of documents kept out, for the report")
    pc = sub.add_parser("compare", help="bytes per token against cl100k_base")
    pc.add_argument("folder")
    pc.add_argument("source")
    args = p.parse_args(argv)
    try:
        if args.cmd == "train":
            return train(args.source, args.out, args.vocab, args.held_out, args.max_docs, args.text_field)
        return compare(args.folder, args.source)
    except corpus.DataError as e:
        raise SystemExit(f"bpe.py: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
