"""64 concurrent streamed completions (300 prompt ids, 400 tokens, greedy, ignore_eos, return_token_ids),
ROUNDS times; per round its wall time and the median over requests of the median gap between chunks."""
import asyncio, random, statistics, sys, time, httpx
port, rounds = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3
async def one(client):
    body = {"model": "stub", "prompt": [random.randrange(4096) for _ in range(300)], "max_tokens": 400,
            "ignore_eos": True, "stream": True, "temperature": 0, "return_token_ids": True}
    times, tokens = [], 0
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                tokens += line.count(",") and 1
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0, len(times)
async def main():
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
        for rep in range(rounds):
            t = time.perf_counter()
            res = await asyncio.gather(*[one(client) for _ in range(64)])
            wall = time.perf_counter() - t
            print(f"round {rep}: {wall:.2f} s, median chunk gap {statistics.median(g for g, _ in res) * 1e3:.2f} ms, "
                  f"chunks per request {min(n for _, n in res)}-{max(n for _, n in res)}", flush=True)
asyncio.run(main())
