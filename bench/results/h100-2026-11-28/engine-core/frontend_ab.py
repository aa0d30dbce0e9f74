"""A/B of issue 38's front-end table: median inter-token latency through LLM.generate with no
tokenizer, with the Gemma tokenizer, and with the tokenizer + 2 stop strings that never match, at batch
1 / 16 / 64 (512-token random prompts, 128 out), next to the decode graph's replay; then the host time
per step with a null forward (a 1-layer, hidden-64 model of the same vocabulary: the step is then the
host's). Public API only, so the same file runs over the baseline tree and this one:

    PYTHONPATH=<tree> [NULL_ONLY=1] python frontend_ab.py LABEL MODEL TOKENIZER_DIR OUT.json
"""
import json
import statistics
import sys

import torch

from bench.common import build_model
from bench.configs import load_config
from bench.decode import graph_replay_ms
from bench.e2e import latencies
from engine import LLM, SamplingParams

label, model, tok_dir, out = sys.argv[1:5]
from transformers import AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(tok_dir)
PROMPT, OUTPUT, BATCHES, REPEATS = 512, 128, (1, 16, 64), 3
STOPS = ("<bench-never-stop-a>", "<bench-never-stop-b>")


def measure(net, vocab, batches, with_replay):
    llm = LLM(net, tokenizer=tok, max_num_seqs=max(batches), max_model_len=PROMPT + OUTPUT + 16, block_size=16,
              prefill_graphs=True, decode_graph_sizes=tuple(batches), show_progress=False)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        for variant in ("none", "tokenizer", "tokenizer+stop"):
            llm.tokenizer = tok if variant != "none" else None
            params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, stop=STOPS if variant.endswith("stop") else ())
            itls = []
            for _ in range(REPEATS + 1):  # the first call warms up
                prompts = torch.randint(0, vocab, (b, PROMPT), generator=g).tolist()
                lat = latencies(llm.generate(prompts, params))
                itls.append(lat["itl_ms"])
            rows.append(dict(batch=b, variant=variant, itl_ms=statistics.median(itls[1:]), itl_runs=itls[1:]))
            print(label, rows[-1], flush=True)
        if with_replay:
            with torch.inference_mode():  # the runner's buffers are inference tensors
                replay = graph_replay_ms(llm.runtime.runner, vocab, b, PROMPT + OUTPUT // 2)
            rows.append(dict(batch=b, variant="graph_replay", itl_ms=replay))
            print(label, rows[-1], flush=True)
    llm.close()
    return rows


config = load_config(model)
vocab = config["vocab_size"]
import os  # noqa: E402

result = {"label": label, "model": model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "rows": [] if os.environ.get("NULL_ONLY") else measure(build_model(model), vocab, BATCHES, True)}
# null forward: the model's family and vocabulary, one layer of hidden 64
import models  # noqa: E402

tiny = {k: v for k, v in config.items() if k not in ("layer_types", "sliding_window_pattern")}
tiny.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            num_hidden_layers=1)
if "query_pre_attn_scalar" in config:
    tiny["query_pre_attn_scalar"] = 16
null = models.from_config(tiny, dtype=torch.bfloat16, device="cuda", seed=0)
result["null_forward"] = measure(null, vocab, (64,), True)
json.dump(result, open(out, "w"), indent=1)
