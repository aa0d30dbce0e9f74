"""The step thread's share of the front end per step at batch 64, inline (update_all) against the
front end's process (TextProcess.poll + hand_over), with the Gemma 3 tokenizer (bench/.tokenizer),
two stop strings per request, one random token per request per step, 2 ms between steps (the
process answers meanwhile, as it would while a GPU step runs). Median of 280 steps after 20.
Run from the repo root: PYTHONPATH=. python bench/results/cpu-2026-12-07/frontend-process/step_share.py
The last column hashes request 0's text: equal in both rows (the same texts)."""
import time, random, statistics, sys
from transformers import PreTrainedTokenizerFast
from engine.core.detokenizer import OutputTracker, BatchDecoder, update_all
from engine.core.text_process import TextProcess
from engine.request import Request
from engine import SamplingParams
tok = PreTrainedTokenizerFast.from_pretrained("bench/.tokenizer")
B = 64
for mode in ("inline", "process"):
    rng = random.Random(0)
    reqs = [Request(str(i), [rng.randrange(1000, 200000) for _ in range(16)], SamplingParams(max_tokens=10000, stop=["<bench-never-stop-a>", "<bench-never-stop-b>"])) for i in range(B)]
    dec = BatchDecoder(tok)
    trs = [OutputTracker(r, tok, dec, local=mode == "inline") for r in reqs]
    front = TextProcess(tok) if mode == "process" else None
    ts = []
    pairs = list(zip(trs, reqs))
    for step in range(300):
        for r in reqs: r.token_ids.append(rng.randrange(1000, 200000))
        t = time.perf_counter()
        if front: front.poll(); front.hand_over(pairs)
        else: update_all(pairs)
        ts.append(time.perf_counter() - t)
        if front and step == 0: front.flush()
        time.sleep(0.002)
    if front: front.flush(); front.close()
    print(mode, f"median {statistics.median(ts[20:])*1e6:.0f} us per step at batch {B}", "text", hash("".join(trs[0].pieces)) % 1000)
