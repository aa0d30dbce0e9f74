import sys, timeit, json, dataclasses
sys.path.insert(0, sys.argv[1])
from engine.outputs import RequestOutput, TextHistory, merged
from engine.entrypoints.server.metrics import ServerMetrics
from engine.entrypoints.server.app import _sse
times = [i * 0.002 for i in range(500)]
h = TextHistory(list(range(800)), 300, 400, [], 0, times)
a = RequestOutput("r", [1, 2], [5], "a", False, None, 0.1, history=h)
b = RequestOutput("r", [1, 2], [6], "b", False, None, None, history=h)
m = ServerMetrics()
chunk = {"id": "cmpl-abc", "object": "text_completion", "created": 1700000000, "model": "m",
         "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None, "token_ids": [1234]}]}
n = 20000
def obs():
    m.observe(b, 396)  # 4 new tokens since the consumer's last look: 4 gaps
for name, fn in (("merged", lambda: merged(a, b)), ("observe 4 tokens", obs), ("_sse", lambda: _sse(chunk))):
    best = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
    print(f"{name}: {best:.2f} us")
