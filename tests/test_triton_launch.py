"""custom_ops.triton_launch: a kernel launched again through its compiled launcher computes what
`kernel[grid](...)` computes, for every specialization Triton distinguishes (pointer alignment, dtype,
integer divisibility and equality to 1, constexprs), on the stream that is current (a graph capture's
too), and leaves the slow path to profilers' launch hooks and the interpreter.

CPU: the cache key and the interpreter path. GPU (`gpu` mark): compiled launches against plain torch."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from custom_ops import triton_launch
from custom_ops.triton_launch import _key, launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _count_kernel(out_ptr, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32) + n * 1000 + m, mask=offs < m)


def axpy(x, y, out, alpha=2.5, block=128, **constexprs):
    n = x.numel()
    launch(_axpy_kernel, (triton.cdiv(n, block),), (x, y, out, n, float(alpha)), dict(BLOCK=block, **constexprs))


def expected(x, y, alpha=2.5, square=False):
    x64 = x.double() ** 2 if square else x.double()
    return (alpha * x64 + y.double()).to(x.dtype)


def test_key_separates_what_triton_specializes_on():
    base = torch.randn(64, dtype=torch.float32)
    key = _key((base, 16, 1.5), {"BLOCK": 32}, 0)
    assert key == _key((torch.randn(64), 16, 1.5), {"BLOCK": 32}, 0)     # another tensor, same specialization
    assert key != _key((base[1:], 16, 1.5), {"BLOCK": 32}, 0)            # 4-byte offset: not 16-byte aligned
    assert key != _key((base.half(), 16, 1.5), {"BLOCK": 32}, 0)         # dtype
    assert key != _key((base, 17, 1.5), {"BLOCK": 32}, 0)                # divisibility by 16
    assert key != _key((base, 1, 1.5), {"BLOCK": 32}, 0)                 # equality to 1 (a constant)
    assert key != _key((base, 2 ** 32, 1.5), {"BLOCK": 32}, 0)           # i64, not i32
    assert _key((base, 2 ** 32, 1.5), {}, 0) != _key((base, 2 ** 63, 1.5), {}, 0)  # u64
    assert key != _key((base, 16, 1.5), {"BLOCK": 64}, 0)                # constexpr
    assert key != _key((base, 16, 1.5), {"BLOCK": 32}, 1)                # device
    assert _key((base, 1, 1.5), {}, 0) != _key((base, True, 1.5), {}, 0)  # True == 1, but not the same type
    assert _key((base, 1, 1.0), {}, 0) != _key((base, 1, 1), {}, 0)      # 1.0 == 1 likewise
    assert _key((base, None), {}, 0) != _key((base, 0), {}, 0)           # None is a constant


def test_key_leaves_out_values_triton_passes_at_run_time():
    """Token counts change every serving step: one compiled variant must serve every count of a class."""
    base = torch.randn(64)
    assert _key((base, 48, 0.5), {}, 0) == _key((base, 4096, 2.0), {}, 0)   # divisible by 16, fp32
    assert _key((base, 17, 0.5), {}, 0) == _key((base, 300, 0.5), {}, 0)    # neither 1 nor divisible
    assert _key((base, True), {}, 0) == _key((base, False), {}, 0)          # i1 either way


def test_key_of_a_do_not_specialize_parameter_is_its_integer_type():
    """Triton passes such a parameter's value without classing it (== 1, divisible by 16): neither does
    the key, so the stored-row counts of successive steps share one entry."""
    from triton.runtime.jit import JITFunction
    from custom_ops.triton_launch import _flagged

    def plain(fn, **kwargs):  # under the interpreter (CPU), the JITFunction Triton would build
        return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **kwargs)

    assert _flagged(plain(_count_kernel, do_not_specialize=["n"]), "do_not_specialize") == (1,)
    assert _flagged(plain(_axpy_kernel), "do_not_specialize") == ()
    x = torch.randn(64)
    assert _key((x, 1, 32), {}, 0, (1,)) == _key((x, 45, 32), {}, 0, (1,)) == _key((x, 48, 32), {}, 0, (1,))
    assert _key((x, 45, 32), {}, 0, (1,)) != _key((x, 45, 33), {}, 0, (1,))  # m is specialized
    assert _key((x, 45, 32), {}, 0, (1,)) != _key((x, 2 ** 40, 32), {}, 0, (1,))  # i64


def test_key_of_a_do_not_specialize_on_alignment_pointer_is_its_dtype():
    """Triton compiles one variant for such a pointer whatever its alignment: the key holds its dtype
    only, so a view at an 8-byte offset (the staging slab's index regions) hits the aligned call's entry."""
    from triton.runtime.jit import JITFunction
    from custom_ops.triton_launch import _flagged

    unaligned = _flagged(JITFunction(_axpy_kernel.fn, do_not_specialize_on_alignment=["x_ptr"]),
                         "do_not_specialize_on_alignment")
    assert unaligned == (0,)
    buffer = torch.randn(65, dtype=torch.float64)
    aligned, shifted = buffer[:64], buffer[1:]  # 8 bytes apart: one of them is not 16-byte aligned
    assert _key((aligned, 3), {}, 0) != _key((shifted, 3), {}, 0)
    assert _key((aligned, 3), {}, 0, (), unaligned) == _key((shifted, 3), {}, 0, (), unaligned)
    assert _key((aligned, 3), {}, 0, (), unaligned) != _key((aligned.float(), 3), {}, 0, (), unaligned)


def test_cache_bookkeeping_with_a_stand_in_kernel(monkeypatch):
    """The hit path without a GPU: a stand-in for a JITFunction whose `kernel[grid](...)` returns a
    compiled object. The first launch of a class compiles (a miss), later ones of that class call the
    compiled launcher with the grid, the current stream, the new values and the tail in signature order,
    and a do_not_specialize count shares one entry."""
    from types import SimpleNamespace
    from custom_ops import triton_launch as tl_mod

    def param(name, constexpr=False, dns=False):
        return SimpleNamespace(name=name, is_constexpr=constexpr, do_not_specialize=dns, has_default=False,
                               do_not_specialize_on_alignment=False)

    runs, plain = [], []
    compiled = SimpleNamespace(function="fn", packed_metadata="meta", run=lambda *a: runs.append(a))

    class StandIn:
        params = [param("x_ptr"), param("n", dns=True), param("m"), param("BLOCK", constexpr=True)]
        pre_run_hooks = []

        def __getitem__(self, grid):
            return lambda *args, **options: plain.append((grid, args, options)) or compiled

    kernel = StandIn()
    monkeypatch.setattr(tl_mod, "interpreting", lambda: False)
    monkeypatch.setattr(tl_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tl_mod, "driver", SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda d: "stream")))
    x = torch.empty(16)
    for n, m in ((45, 7), (3, 9), (1000, 5)):   # n: one entry whatever its value; m: "i32" each time
        launch(kernel, (4, 2), (x, n, m), {"BLOCK": 64})
    launch(kernel, (4,), (x, 8, 32), {"BLOCK": 64})   # m divisible by 16: a class of its own
    try:
        assert [p[1][1:] for p in plain] == [(45, 7), (8, 32)]
        assert runs == [(4, 2, 1, "stream", "fn", "meta", None, None, None, x, 3, 9, 64),
                        (4, 2, 1, "stream", "fn", "meta", None, None, None, x, 1000, 5, 64)]
        assert len(tl_mod._caches[kernel].entries) == 2 and tl_mod._caches[kernel].unspecialized == (1,)
    finally:
        tl_mod._caches.pop(kernel, None)


def test_tail_refuses_a_constexpr_bound_positionally():
    """Its value would have to be in the key: such a call keeps the plain launch."""
    from triton.runtime.jit import JITFunction
    from custom_ops.triton_launch import _tail
    from tests.test_qkv_rope import rope_tables
    kernel = _axpy_kernel if isinstance(_axpy_kernel, JITFunction) else JITFunction(_axpy_kernel.fn)
    x = torch.empty(4)
    assert _tail(kernel, (x, x, x, 4, 1.0, 8), {}) is None


def test_tail_lists_the_later_parameters_in_signature_order():
    """What the direct launch appends after the positional arguments: every later parameter, from the
    keywords or its default, in the kernel's order; None (the plain launch) where that is not known."""
    from triton.runtime.jit import JITFunction
    from custom_ops.triton_launch import _tail
    from tests.test_qkv_rope import rope_tables
    kernel = _axpy_kernel if isinstance(_axpy_kernel, JITFunction) else JITFunction(_axpy_kernel.fn)
    x = torch.empty(4)
    assert _tail(kernel, (x, x, x, 4, 1.0), {"BLOCK": 8}) == (8, False)               # SQUARE's default
    assert _tail(kernel, (x, x, x, 4, 1.0), {"SQUARE": True, "BLOCK": 8, "num_warps": 4}) == (8, True)
    assert _tail(kernel, (x, x, x, 4), {"BLOCK": 8, "alpha": 2.0}) == (2.0, 8, False)  # a scalar by keyword
    assert _tail(kernel, (x, x, x, 4, 1.0), {}) is None                                # BLOCK missing
    assert _tail(kernel, (x, x, x, 4, 1.0), {"n": 3, "BLOCK": 8}) is None              # n given twice


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter path")
def test_interpreter_takes_the_plain_launch():
    x, y, out = torch.randn(300), torch.randn(300), torch.empty(300)
    before = dict(triton_launch.stats)
    axpy(x, y, out)
    axpy(x, y, out)
    torch.testing.assert_close(out, expected(x, y))
    assert triton_launch.stats["slow"] == before["slow"] + 2
    assert triton_launch.stats["hits"] == before["hits"]


@pytest.fixture
def fresh_cache():
    triton_launch._caches.pop(_axpy_kernel, None)
    yield
    triton_launch._caches.pop(_axpy_kernel, None)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_hits_match_a_plain_launch_for_each_specialization(fresh_cache, n, dtype):
    before = dict(triton_launch.stats)
    for offset in (0, 1, 0, 1):  # aligned, misaligned (a new specialization), then both again as hits
        x = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        y = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        out = torch.empty(n + offset, device="cuda", dtype=dtype)[offset:]
        axpy(x, y, out)
        torch.testing.assert_close(out, expected(x, y))
        plain = torch.empty_like(out)
        _axpy_kernel[(triton.cdiv(n, 128),)](x, y, plain, n, 2.5, BLOCK=128)
        assert torch.equal(out, plain)
    assert triton_launch.stats["misses"] - before["misses"] == 2
    assert triton_launch.stats["hits"] - before["hits"] == 2


@pytest.mark.gpu
def test_gpu_a_hit_with_another_value_of_the_class_uses_that_value(fresh_cache):
    """One compiled variant per class, the values passed at each launch: counts of one class give their
    own results (a variant that had kept the first count would write the wrong rows)."""
    before = dict(triton_launch.stats)
    x, y = torch.randn(5000, device="cuda"), torch.randn(5000, device="cuda")
    for n, alpha in ((300, 2.5), (17, -1.0), (4095, 0.25), (33, 3.0)):  # none is 1 or divisible by 16
        out = torch.full_like(x, float("nan"))
        axpy(x[:n], y[:n], out[:n], alpha=alpha)
        torch.testing.assert_close(out[:n], expected(x[:n], y[:n], alpha=alpha))
        assert out[n:].isnan().all(), f"n={n}: the launch wrote past its count"
    assert triton_launch.stats["misses"] - before["misses"] == 1
    assert triton_launch.stats["hits"] - before["hits"] == 3


@pytest.mark.gpu
def test_gpu_do_not_specialize_values_share_one_variant_and_reach_the_kernel():
    triton_launch._caches.pop(_count_kernel, None)
    before = dict(triton_launch.stats)
    for n in (1, 16, 45, 7):  # one class for Triton and for the key
        out = torch.full((64,), float("nan"), device="cuda")
        launch(_count_kernel, (1,), (out, n, 40), dict(BLOCK=64))
        assert (out[:40] == n * 1000 + 40).all() and out[40:].isnan().all(), f"n={n}"
    assert triton_launch.stats["misses"] - before["misses"] == 1
    assert triton_launch.stats["hits"] - before["hits"] == 3
    triton_launch._caches.pop(_count_kernel, None)


@pytest.mark.gpu
def test_gpu_constexprs_and_defaults_reach_the_kernel(fresh_cache):
    x, y = torch.randn(500, device="cuda"), torch.randn(500, device="cuda")
    for square in (False, True, False, True):
        out = torch.empty_like(x)
        axpy(x, y, out, SQUARE=square)
        torch.testing.assert_close(out, expected(x, y, square=square))
    for block in (64, 256, 64):  # BLOCK changes the grid and the compiled kernel
        out = torch.empty_like(x)
        axpy(x, y, out, block=block)
        torch.testing.assert_close(out, expected(x, y))


@pytest.mark.gpu
def test_gpu_hit_launches_on_the_current_stream_and_inside_a_capture(fresh_cache):
    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    axpy(x, y, out)  # the miss: compiles and launches plainly
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # if the hit went to another stream, it would finish first
        x2 = x * 3
        axpy(x2, y, out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, expected(x * 3, y))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        axpy(x, y, out)  # a hit recorded into the graph
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        y.copy_(torch.randn_like(y))
        graph.replay()
        torch.testing.assert_close(out, expected(x, y))


@pytest.mark.gpu
def test_gpu_launch_hooks_keep_the_plain_path(fresh_cache):
    from triton import knobs
    x, y, out = (torch.randn(256, device="cuda") for _ in range(3))
    axpy(x, y, out)
    seen = []
    hook = seen.append
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # recent Triton: a chain of hooks, empty where none is set
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        axpy(x, y, out)
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    torch.cuda.synchronize()
    assert len(seen) == 1  # the profiler's hook saw the launch
    torch.testing.assert_close(out, expected(x, y))


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_lens, query_lens", [([0, 17], [40, 9]), ([30, 5, 70], [1, 1, 1])],
                         ids=["prefill", "decode"])
def test_gpu_attention_repeats_hit_and_match_the_reference(prefix_lens, query_lens):
    """The prefill and decode kernels of a step's layers share one compiled launch: every launch after
    the first is a hit, with results at the float64 reference (tests.test_triton_attention)."""
    from custom_ops import AttentionLayer
    from tests.test_triton_attention import check_close, make_batch, reference_paged, run_paged
    layer = AttentionLayer(8, 2, 128, 128 ** -0.5, None, None)
    q, k, v, cache, meta = make_batch(prefix_lens, query_lens, layer, 16, torch.bfloat16, "cuda")
    run_paged(q, k, v, cache, meta, layer)
    before = dict(triton_launch.stats)
    for _ in range(3):
        out = run_paged(q, k, v, cache, meta, layer)
        ref, _ = reference_paged(q, k, v, cache, meta, layer)
        check_close(out, ref, meta.num_actual_tokens, torch.bfloat16)
    assert triton_launch.stats["hits"] - before["hits"] == 3
    assert triton_launch.stats["misses"] == before["misses"]


@pytest.mark.gpu
def test_gpu_prefill_steps_of_new_token_counts_hit_after_one_per_class():
    """Serving: every step has its own token count, padded to a capture size. After one launch per
    specialization class (padded or not, token count divisible by 16 or not), each new count is a hit,
    and each is attended with its own counts (float64 reference, padding rows zero)."""
    from custom_ops import AttentionLayer
    from tests.test_triton_attention import check_close, make_batch, reference_paged, run_paged
    layer = AttentionLayer(8, 2, 128, 128 ** -0.5, None, None)
    # (cached prefix lengths, new tokens, padding rows): the stored-row count and the padding's start are
    # do_not_specialize, the padded size (a capture size) is divisible by 16 (48; 0 unpadded) or not (45),
    # and the block tables are 4 pages + 1 wide throughout: the first two cases are the two classes.
    cases = [([0], [45], 3), ([0], [40], 5), ([5], [36], 7), ([0], [35], 13), ([1], [44], 0), ([0], [33], 0),
             ([2], [46], 16), ([0], [47], 1)]
    before = dict(triton_launch.stats)
    for i, (prefix_lens, query_lens, pad) in enumerate(cases):
        q, k, v, cache, meta = make_batch(prefix_lens, query_lens, layer, 16, torch.bfloat16, "cuda", pad_tokens=pad)
        assert meta.block_tables.shape[1] == 4
        out = run_paged(q, k, v, cache, meta, layer)
        ref, _ = reference_paged(q, k, v, cache, meta, layer)
        check_close(out, ref, meta.num_actual_tokens, torch.bfloat16)
        if i == 1:
            first = dict(triton_launch.stats)
    assert triton_launch.stats["misses"] == first["misses"], "a new token count of a seen class missed"
    assert triton_launch.stats["hits"] - first["hits"] == len(cases) - 2


def _op_launches(monkeypatch):
    """Every launch the ops' Triton kernels make, recorded (kernel, grid, args, options) and then made."""
    import importlib
    calls = []
    real = triton_launch.launch
    for name in ("triton_rms_norm", "triton_rope", "triton_gemv", "triton_gemv_rope", "triton_skinny",
                 "triton_kv_store", "triton_argmax"):
        module = importlib.import_module(f"custom_ops.{name}")
        monkeypatch.setattr(module, "launch", lambda k, g, a, o: calls.append((k, g, a, o)) or real(k, g, a, o))
    return calls


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors through the interpreter; on a GPU each op's own tests "
                    "(test_add_rms_norm, test_triton_gemv, ...) launch it through the compiled launcher")
def test_the_ops_kernels_launch_through_the_cache_with_arguments_the_compiled_launcher_takes(monkeypatch):
    """On a GPU a launch skips JITFunction.run only where its arguments bind positionally and its
    constexprs by keyword (`_tail`); steps without a graph (and eager models) launch these kernels
    once or more per layer. Each op runs here in the interpreter, and its result is checked."""
    from triton.runtime.jit import JITFunction
    from custom_ops.gemv_table import GemvConfig
    from custom_ops.triton_gemv import gemv
    from custom_ops.triton_gemv_rope import gemv_rope
    from custom_ops.triton_kv_store import store_kv
    from custom_ops.triton_rms_norm import add_rms_norm_triton
    from custom_ops.triton_rope import qk_norm_rope_triton
    from custom_ops.triton_skinny import skinny_gemm
    from custom_ops.triton_argmax import verify_greedy_from_keys
    from custom_ops.triton_launch import _tail
    from tests.test_qkv_rope import rope_tables

    calls = _op_launches(monkeypatch)
    torch.manual_seed(0)
    h, delta, weight = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    total, _ = add_rms_norm_triton(h, delta, weight, 1e-6, False)
    torch.testing.assert_close(total, h + delta)
    cos, sin = rope_tables(16, 7, torch.float32)  # [head_dim / 2] of one position
    q_in, k_in = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    q, _ = qk_norm_rope_triton(q_in, k_in, cos.expand(5, -1), sin.expand(5, -1), None, None, 1e-6, False)
    assert q.shape == q_in.shape and not torch.equal(q, q_in)
    x, w = torch.randn(1, 48), torch.randn(24, 48)
    torch.testing.assert_close(gemv(x, w, GemvConfig(block_n=16, block_k=16, num_warps=1)), x @ w.t(),
                               rtol=1e-4, atol=1e-4)
    x2 = torch.randn(3, 48)
    torch.testing.assert_close(skinny_gemm(x2, w, GemvConfig(block_n=16, block_k=16, num_warps=1)), x2 @ w.t(),
                               rtol=1e-4, atol=1e-4)
    w_qkv = torch.randn((4 + 2 * 2) * 16, 48)
    qkv, _, _ = gemv_rope(x, w_qkv, cos, sin, GemvConfig(block_n=4, block_k=16, num_warps=1), 4, 2)
    torch.testing.assert_close(qkv, x @ w_qkv.t(), rtol=1e-4, atol=1e-4)
    cache = torch.zeros(2, 3, 4, 2, 16)
    k, v, slots = torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor([5, 0, 11])
    store_kv(k, v, cache, slots, 3)
    assert torch.equal(cache[0].reshape(12, 2, 16)[slots], k) and torch.equal(cache[1].reshape(12, 2, 16)[slots], v)
    k_in3, v3 = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    _, k3 = qk_norm_rope_triton(torch.randn(3, 4, 16), k_in3, cos.expand(3, -1), sin.expand(3, -1), None, None, 1e-6,
                                False, store=(v3, cache, slots, 3))
    assert torch.equal(cache[0].reshape(12, 2, 16)[slots], k3) and torch.equal(cache[1].reshape(12, 2, 16)[slots], v3)
    staged = torch.tensor([[0, 1, 2], [5, 8, -1]])
    keys = torch.tensor([[9, 3], [1, 2], [4, 4]]) << 32 | (0x7FFFFFFF - torch.tensor([[5, 6], [7, 8], [9, 10]]))
    assert verify_greedy_from_keys(keys, staged[:1], staged[1:, :2]).tolist() == [[5, 8, 9]]  # ties: lower index

    launched = {k.fn.__name__ for k, *_ in calls}
    assert launched == {"_add_rms_norm_kernel", "_qk_norm_rope_kernel", "_gemv_kernel", "_skinny_kernel",
                        "_gemv_rope_kernel", "_store_kv_kernel", "_verify_keys_kernel"}
    for kernel, _, args, options in calls:
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # the interpreter wraps it
        assert _tail(jit, args, options) is not None, kernel.fn.__name__
