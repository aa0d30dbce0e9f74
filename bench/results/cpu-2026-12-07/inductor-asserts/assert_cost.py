import statistics, time, torch
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
x = torch.empty(16, 64); w = torch.empty(192, 64)
def t(fn, n=100000):
    r = []
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(n): fn()
        r.append((time.perf_counter() - s) / n * 1e9)
    return min(r)
a = t(lambda: assert_size_stride(x, (16, 64), (64, 1), 'input'))
b = t(lambda: assert_alignment(x, 16, 'op'))
c = t(lambda: None)
print(f"assert_size_stride {a-c:.0f} ns, assert_alignment {b-c:.0f} ns (loop overhead {c:.0f} ns subtracted)")
