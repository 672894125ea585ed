# bytes per token on the stdlib documents bpe.train held out (1%): ours at 4096 / 32768 ids vs cl100k_base cut to the same sizes and whole
import os, sys; sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import time, bpe, corpus, shards, tokenizer
held = [d for i, d in enumerate(corpus.iter_documents("stdlib")) if shards.is_val(i, 0.01)]
for vocab in (4096, 32768):
    t = time.perf_counter()
    rep = bpe.train("stdlib", f"/tmp/bpe_stdlib_{vocab}", vocab=vocab, held_out=0.01, verbose=False)
    print(f"ours vocab={vocab}: trained in {time.perf_counter() - t:.0f} s; {rep['documents']} held-out documents, "
          f"{rep['ours']['bytes']:,} bytes: {rep['ours']['bytes_per_token']:.3f} bytes/token")
    for ref in ((f"cl100k_base", vocab), ("cl100k_base", 0)):
        b, n, r = bpe.bytes_per_token(tokenizer.get_tokenizer(*ref), held)
        print(f"  cl100k_base{'_' + str(ref[1]) if ref[1] else ''}: {r:.3f} bytes/token")
