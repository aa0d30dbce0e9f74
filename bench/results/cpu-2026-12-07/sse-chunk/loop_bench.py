"""The event loop's own work per streamed chunk, without HTTP and without the engine: the server's app
(build_app, behind its Guard) over a stand-in engine, called through ASGI in one process. 64 streamed
completions (return_token_ids, as bench serving asks) are accepted; then each "step" puts one
RequestOutput per request on the loop exactly as the engine thread does (engine_loop._put_all, one
callback per step), and the loop runs until every chunk of the step went to `send`. Prints the
median over rounds of microseconds per chunk. Usage: loop_bench.py REPO [STEPS] [ROUNDS]"""
import asyncio, json, statistics, sys, time, types, concurrent.futures
sys.path.insert(0, sys.argv[1])
from engine.outputs import RequestOutput, TextHistory
from engine.entrypoints.server.app import build_app
from engine.entrypoints.server import engine_loop as el

STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
BATCH = 64


class StandInEngine:
    """What the app reads of EngineLoop; submit accepts at once and remembers the stream."""
    def __init__(self):
        self.llm = types.SimpleNamespace(tokenizer=None, encode=lambda text, tokenizer=None: [],
                                         config=types.SimpleNamespace(max_model_len=4096, device="cpu"))
        self.max_waiting, self.num_waiting, self.num_admitting = None, 0, 0
        self.accepting = self.healthy = True
        self.snapshot = {}
        self.streams = []

    def queue_full(self):
        return False

    def submit(self, prompt, params, request_id, into, index=0, every_step=True):
        stream = el.Stream(request_id, asyncio.get_running_loop(), into, index, every_step)
        stream.prompt = prompt
        self.streams.append(stream)
        stream.put(el.ACCEPTED)
        return stream

    def abort(self, request_id):
        pass


async def one_round(app, engine):
    sent = [0]
    done = asyncio.Event()
    target = [0]

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sent[0] += 1
            if sent[0] >= target[0]:
                done.set()

    async def call(i):
        body = json.dumps({"model": "m", "prompt": list(range(300)), "max_tokens": STEPS, "stream": True,
                           "return_token_ids": True, "ignore_eos": True}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client never leaves
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                 (b"content-length", str(len(body)).encode())], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                 "state": {}}
        await app(scope, receive, send)

    engine.streams.clear()
    tasks = [asyncio.create_task(call(i)) for i in range(BATCH)]
    while len(engine.streams) < BATCH:
        await asyncio.sleep(0)
    histories = {}
    for s in engine.streams:
        histories[s.request_id] = TextHistory(list(s.prompt), len(s.prompt), 0, [], 0, [])
    loop = asyncio.get_running_loop()
    start = None
    for step in range(STEPS):
        if step == 10:
            start, first = time.perf_counter(), sent[0]
        items = []
        now = time.monotonic()
        last = step == STEPS - 1
        for s in engine.streams:
            h = histories[s.request_id]
            h.all_token_ids.append(1000 + step)
            h.token_times.append(now)
            h.text_pieces.append(" tok")
            h = histories[s.request_id] = h._replace(num_output_tokens=h.num_output_tokens + 1,
                                                     num_text_pieces=h.num_text_pieces + 1)
            items.append((s, RequestOutput(s.request_id, h.all_token_ids[:h.num_prompt_tokens], [1000 + step], " tok",
                                           last, "length" if last else None, 0.01, history=h)))
        target[0] = sent[0] + BATCH
        done.clear()
        loop.call_soon(el._put_all, items)
        await done.wait()
    elapsed = time.perf_counter() - start
    chunks = sent[0] - first
    await asyncio.gather(*tasks)
    return elapsed / chunks * 1e6


async def main():
    engine = StandInEngine()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    app = build_app(engine, "m", pool)
    results = [await one_round(app, engine) for _ in range(ROUNDS)]
    print(f"us per chunk, rounds: {' '.join(f'{r:.1f}' for r in results)}; median {statistics.median(results):.1f}")

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
