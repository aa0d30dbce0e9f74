"""The attention op's own host cost in a piecewise prefill step, with and without the rotary arguments
(the kernels replaced by a no-op). Run on the CPU from the repo root: PYTHONPATH=. python <this file>."""
import timeit, torch, custom_ops
from custom_ops import AttentionLayer, RuntimeMode, register_attention_layer, run_attention, reference
from tests.paged_helpers import build_metadata
reference.paged_attention = lambda *a, **k: None  # the host path only
register_attention_layer("h", AttentionLayer(4, 1, 256, 0.0625, qk_norm_eps=1e-6, qk_norm_unit_offset=True))
meta = build_metadata(16, [[1, 2, 3, 4, 5, 6, 7, 8]], cached_lens=[0], new_lens=[128])
cache = custom_ops.allocate_kv_cache(10, 16, 1, 256, torch.float32, "cpu")
qkv = torch.randn(128, 6 * 256)
q, k, v = qkv[:, :1024].view(128, 4, 256), qkv[:, 1024:1280].view(128, 1, 256), qkv[:, 1280:].view(128, 1, 256)
out = torch.empty_like(q); cos = sin = torch.randn(128, 128); w = torch.randn(256)
with custom_ops.forward_context(meta, RuntimeMode.PIECEWISE, kv_caches={"h": cache}):
    for label, args in (("5 args (llama, base)", (q, k, v, out, "h")),
                        ("11 args, piecewise prefill", (q, k, v, out, "h", q, k, cos, sin, w, w))):
        n = 20000
        t = min(timeit.repeat(lambda: run_attention(*args), number=n, repeat=5)) / n
        print(f"{label}: {t * 1e6:.2f} us per call")
