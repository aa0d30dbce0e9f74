import sys, asyncio, time, random, httpx, os
port, pid = int(sys.argv[1]), int(sys.argv[2])
HZ = os.sysconf("SC_CLK_TCK")
def main_cpu():
    f = open(f"/proc/{pid}/task/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ
def all_cpu():
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ
async def one(c):
    body = {"model": "stub", "prompt": [random.randrange(4096) for _ in range(300)], "max_tokens": 400,
            "ignore_eos": True, "stream": True, "temperature": 0, "return_token_ids": True}
    n = 0
    async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
    return n
async def main():
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
        for rep in range(3):
            m0, a0, t = main_cpu(), all_cpu(), time.perf_counter()
            ns = await asyncio.gather(*[one(c) for _ in range(64)])
            m1, a1 = main_cpu(), all_cpu()
            print(f"rep {rep}: {time.perf_counter()-t:.2f} s, {sum(ns)} chunks, event loop {(m1-m0)/sum(ns)*1e6:.0f} us/chunk, process {a1-a0:.2f} s cpu", flush=True)
asyncio.run(main())
