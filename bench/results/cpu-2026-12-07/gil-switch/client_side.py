"""64 concurrent requests of 300 prompt ids, max_tokens 400, ignore_eos, stream or not, twice."""
import sys, asyncio, json, time, random, httpx
port, stream = int(sys.argv[1]), sys.argv[2] == "stream"
async def one(client, i):
    body = {"model": "stub", "prompt": [random.randrange(4096) for _ in range(300)], "max_tokens": 400,
            "ignore_eos": True, "stream": stream, "temperature": 0, "return_token_ids": stream}
    n = 0
    if stream:
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
    else:
        r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        n = r.json()["usage"]["completion_tokens"]
    return n
async def main():
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
        for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
            t = time.perf_counter()
            ns = await asyncio.gather(*[one(client, i) for i in range(64)])
            print(f"{'stream' if stream else 'plain'} rep {rep}: {time.perf_counter()-t:.1f} s, chunks/tokens per request {min(ns)}-{max(ns)}", flush=True)
asyncio.run(main())
