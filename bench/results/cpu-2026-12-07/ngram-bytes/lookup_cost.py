"""One prompt-lookup proposal as the proposer makes it each step, for one request of L tokens that
gained one token since the last step (k = 4, n-gram 3..1): the whole list converted to int32 bytes
(before) against the request's TokenBytes extended by the new token (after). One thread, CPU.

    PYTHONPATH=. python bench/results/cpu-2026-12-07/ngram-bytes/lookup_cost.py"""
import array, statistics, time
from engine.spec.ngram import TokenBytes, ngram_propose

for length in (200, 1600, 4000):
    tokens = [100 + (i % 50) for i in range(length)]  # each continuation 50 tokens back
    kept = TokenBytes()
    kept.update(tokens[:-1])

    def after():
        kept.length, kept.last = length - 1, tokens[-2]   # as if the last token had just arrived
        del kept.data[(length - 1) * 4:]
        return ngram_propose(tokens, 4, 1, 3, kept.update(tokens))

    def before():
        return ngram_propose(tokens, 4, 1, 3)

    assert after() == before() == tokens[-50:-46]
    runs = {}
    for name, fn in (("before", before), ("after", after)):
        best = []
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(5000):
                fn()
            best.append((time.perf_counter() - s) / 5000 * 1e6)
        runs[name] = min(best)
    print(f"L={length}: before {runs['before']:.2f} us, after {runs['after']:.2f} us")
