import sys, asyncio, time, httpx
port = int(sys.argv[1])
async def one(c):
    n = 0
    async with c.stream("GET", f"http://127.0.0.1:{port}/s") as r:
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
    return n
async def main():
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
        for rep in range(4):
            c0 = (await c.get(f"http://127.0.0.1:{port}/cpu")).json()["cpu"]
            t = time.perf_counter(); ns = await asyncio.gather(*[one(c) for _ in range(64)])
            c1 = (await c.get(f"http://127.0.0.1:{port}/cpu")).json()["cpu"]
            print(f"rep {rep}: {time.perf_counter()-t:.2f} s wall, server cpu {(c1-c0)/sum(ns)*1e6:.1f} us/chunk ({sum(ns)} chunks)")
asyncio.run(main())
