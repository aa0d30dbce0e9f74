"""Profile LLM.generate decode steps: what the GPU runs between two decode-graph replays."""
import json, statistics, sys, tempfile, os
sys.path.insert(0, ".")
import torch
from bench.common import build_model
from engine import LLM, SamplingParams
from engine.config import default_decode_graph_sizes

model = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-1b"
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,64").split(",")]
net = build_model(model)
llm = LLM(net, max_num_seqs=max(batches), max_model_len=512 + 64 + 16, block_size=16, prefill_graphs=True,
          show_progress=False, decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(max(batches))) | set(batches))))
vocab = net.config.vocab_size
g = torch.Generator().manual_seed(0)
for b in batches:
    prompts = lambda: torch.randint(0, vocab, (b, 512), generator=g).tolist()
    llm.generate(prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
    p = prompts()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(p, SamplingParams(max_tokens=32, ignore_eos=True))
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    runtime = {e["args"].get("correlation"): e["name"] for e in ev if e.get("cat") == "cuda_runtime" and "args" in e}
    gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
    for e in gpu:
        e["graph"] = runtime.get(e["args"].get("correlation")) == "cudaGraphLaunch"
        e["launcher"] = runtime.get(e["args"].get("correlation"))
    # group consecutive graph events by correlation (one replay)
    segments, cur = [], None
    for e in gpu:
        key = ("G", e["args"].get("correlation")) if e["graph"] else ("E",)
        if cur is None or cur[0] != key:
            cur = [key, []]
            segments.append(cur)
        cur[1].append(e)
    replays = [s for s in segments if s[0][0] == "G" and len(s[1]) > 50]  # decode graphs (pieces are short)
    gaps = []
    print(f"===== {model} batch {b}: {len(gpu)} GPU events, {len(replays)} long graph replays")
    for r0, r1 in zip(replays, replays[1:]):
        end = max(e["ts"] + e["dur"] for e in r0[1]); start = min(e["ts"] for e in r1[1])
        gaps.append(start - end)
    if gaps:
        durs = [max(e["ts"] + e["dur"] for e in r[1]) - min(e["ts"] for e in r[1]) for r in replays]
        print(f"replay span median {statistics.median(durs):.1f} us; gap between replays median {statistics.median(gaps):.1f} us "
              f"(min {min(gaps):.1f}, max {max(gaps):.1f})")
        # detail of the gap around the median
        i = sorted(range(len(gaps)), key=lambda k: gaps[k])[len(gaps) // 2]
        r0, r1 = replays[i], replays[i + 1]
        end = max(e["ts"] + e["dur"] for e in r0[1]); start = min(e["ts"] for e in r1[1])
        print("  last graph kernels:", [ (e["name"][:40], round(e["dur"],1)) for e in r0[1][-3:]])
        prev = end
        for e in gpu:
            if end <= e["ts"] < start:
                print(f"  +{e['ts'] - prev:6.1f} idle  {e['dur']:6.1f} us  {e['cat']:10s} {str(e['launcher'])[:22]:22s} {e['name'][:90]}")
                prev = e["ts"] + e["dur"]
        print(f"  +{start - prev:6.1f} idle  -> next replay")
llm.close()
