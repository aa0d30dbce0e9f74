"""The kernel census (bench/kernels.py): classification by kernel name and counting per step and layer."""
from __future__ import annotations

import pytest
import torch

from bench.profiling import KERNEL_KINDS, classify_kernel, kernel_census, short_kernel_name

# Names as torch.profiler reports them on an H100 (cuBLAS, aten, Inductor, our Triton kernels).
NAMES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(Params)": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)": "gemm_splitk_reduce",
    "_decode_kernel": "attention",
    "_prefill_kernel": "attention",
    "_merge_splits_kernel": "attention_merge",
    "_store_kv_kernel": "kv_store",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norm",
    "triton_per_fused_add_mean_mul_pow_rsqrt_3": "norm",
    "triton_poi_fused_cat_mul_2": "fused_elementwise",
    "triton_poi_fused__to_copy_4": "fused_elementwise",   # Inductor's copy is fused work, not a memcpy
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>(int, T1)": "copy",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
    "at::native::ArgMaxOps<float>>>": "reduce",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, T2, T3)": "elementwise",
    "_add_rms_norm_kernel": "norm",
    "_qk_norm_rope_kernel": "rope",
    "some_unknown_kernel": "other",
}


@pytest.mark.parametrize("name,kind", list(NAMES.items()))
def test_kernel_names_map_to_their_kind(name, kind):
    assert classify_kernel(name) == kind


def test_census_counts_per_step_and_per_layer_and_sums_time():
    layers, steps = 4, 3
    one_step = []
    for _ in range(layers):
        one_step += [("nvjet_qkv", 3.0), ("triton_per_fused_add_mean_mul_pow_rsqrt_0", 1.0), ("_decode_kernel", 2.0),
                     ("nvjet_o", 2.0), ("triton_poi_fused_mul_silu_1", 1.0)]
    one_step += [("nvjet_lm_head", 10.0), ("Memcpy DtoD (Device -> Device)", 0.5)]
    rows = {r["kind"]: r for r in kernel_census(one_step * steps, steps, layers)}
    assert list(rows) == ["gemm", "attention", "norm", "fused_elementwise", "copy", "total"]  # KERNEL_KINDS order
    assert rows["gemm"]["per_step"] == 2 * layers + 1
    assert rows["gemm"]["per_layer"] == pytest.approx((2 * layers + 1) / layers)
    assert rows["gemm"]["us_per_step"] == pytest.approx(5.0 * layers + 10.0)
    assert rows["attention"]["per_layer"] == 1.0
    assert rows["copy"]["per_layer"] == pytest.approx(1 / layers)
    assert rows["total"]["per_step"] == len(one_step)
    assert rows["total"]["us_per_step"] == pytest.approx(sum(d for _, d in one_step))
    assert rows["gemm"]["names"] == "nvjet_qkv, nvjet_o, nvjet_lm_head"


def test_every_kind_a_name_can_get_is_listed_for_display():
    from bench.profiling import _KIND_PATTERNS
    assert {kind for kind, _ in _KIND_PATTERNS} | {"other"} == set(KERNEL_KINDS)


def test_census_refuses_zero_steps():
    with pytest.raises(ValueError, match="num_steps"):
        kernel_census([], 0, 2)


def test_short_kernel_name_drops_return_type_and_templates():
    assert short_kernel_name("void at::native::reduce_kernel<512, 1>(T)") == "at::native::reduce_kernel"
    assert len(short_kernel_name("x" * 100, width=20)) == 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_kernels_suite_refuses_to_count_without_cuda():
    from bench import kernels
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernels.run("tiny-llama")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the suite's plumbing")
def test_kernels_suite_runs_every_part_through_the_engine_runner_on_cpu(monkeypatch):
    """Without CUDA there are no kernels to count: the profiler is replaced by one that runs the step
    for real (a wrong buffer or metadata would fail here) and reports one synthetic GEMM per call."""
    from bench import kernels
    calls = {}

    def fake_profile(step, num_steps=kernels.STEPS, warmup=3):
        result = step()
        calls[len(calls)] = result
        return [("nvjet_fake", 2.0)] * num_steps

    monkeypatch.setattr(kernels, "_require_cuda", lambda: None)
    monkeypatch.setattr(kernels, "profile_steps", fake_profile)
    monkeypatch.setattr(kernels, "PREFILL_TOKENS", 32)
    report = kernels.run("tiny-llama", batches="1,2", contexts="16", num_steps=2)
    assert [(r["part"], r["batch"]) for r in kernels.run("tiny-llama", batches="1", contexts="16", num_steps=1).rows
            if r["kind"] == "total"][-1] == ("prefill_pieces", 1)  # one short sequence: the pool still fits
    parts = [(r["part"], r["batch"]) for r in report.rows if r["kind"] == "total"]
    assert parts == [("decode_pieces", 1), ("sample_greedy", 1), ("sample_topp", 1), ("decode_pieces", 2),
                     ("sample_greedy", 2), ("sample_topp", 2), ("prefill_pieces", 1)]
    assert all(r["per_step"] == 1.0 and r["per_layer"] == 0.5 for r in report.rows)  # 2 layers
    logits, greedy = calls[3], calls[4]
    assert logits.shape == (2, 256) and torch.equal(greedy, logits.argmax(-1))
    assert calls[6].shape == (1, 256)


def test_kernels_suite_loads_the_sliding_window_groups_tables_on_cpu(monkeypatch):
    """Gemma 3's sliding layers read their own KV group's tables: the decode and prefill steps the
    suite loads must fill them (a stale or empty group table reads out of the group's pool)."""
    from bench import kernels
    outputs = []

    def fake_profile(step, num_steps=kernels.STEPS, warmup=3):
        outputs.append(step())
        return [("nvjet_fake", 2.0)] * num_steps

    monkeypatch.setattr(kernels, "_require_cuda", lambda: None)
    monkeypatch.setattr(kernels, "profile_steps", fake_profile)
    monkeypatch.setattr(kernels, "PREFILL_TOKENS", 32)
    kernels.run("tiny-gemma3", batches="2", contexts="24", num_steps=1)
    assert all(torch.isfinite(out.float()).all() for out in outputs if isinstance(out, torch.Tensor))


@pytest.mark.gpu
def test_census_of_the_tiny_decode_graph_has_one_attention_kernel_per_layer():
    from bench import kernels
    report = kernels.run("tiny-llama", batches="1", num_steps=2)
    rows = {(r["part"], r["kind"]): r for r in report.rows}
    layers = report.meta["num_layers"]
    assert rows[("decode_graph", "attention")]["per_layer"] == 1.0
    assert ("decode_graph", "kv_store") not in rows          # the store is fused into the decode kernel
    assert ("decode_graph", "attention_merge") not in rows   # the last split merges in the same launch
    assert ("prefill_pieces", "kv_store") not in rows        # the prefill kernel stores too
    assert rows[("prefill_pieces", "attention")]["per_layer"] == 1.0
    assert rows[("decode_graph", "gemm")]["per_step"] >= 4 * layers + 1   # qkv, o, gate_up, down, lm head
    assert rows[("sample_greedy", "total")]["per_step"] >= 1


# ---- the gemm suite (bench/gemm.py)

def test_decode_gemm_shapes_are_the_models_fused_linears():
    from bench.gemm import model_gemm_shapes
    assert model_gemm_shapes("llama-3.2-3b") == [("qkv", 5120, 3072), ("o", 3072, 3072), ("gate_up", 16384, 3072),
                                                 ("down", 3072, 8192), ("lm_head", 128256, 3072)]
    assert dict((name, (n, k)) for name, n, k in model_gemm_shapes("gemma-3-1b"))["qkv"] == (1536, 1152)
    # one rank of two: heads, intermediate size and vocabulary halved (qwen3-4b: 32 q / 8 KV heads of 128)
    assert model_gemm_shapes("qwen3-4b", 2) == [("qkv", 3072, 2560), ("o", 2560, 2048), ("gate_up", 9728, 2560),
                                                ("down", 2560, 4864), ("lm_head", 75968, 2560)]
    # gemma-3-1b's single KV head (of 256) is replicated: each rank has 2 of the 4 q heads and the KV head
    assert dict((n, (a, b)) for n, a, b in model_gemm_shapes("gemma-3-1b", 2))["qkv"] == (2 * 256 + 2 * 256, 1152)


def test_gemm_step_note_weighs_layers_and_the_lm_head_once():
    from bench.gemm import step_note
    rows = [dict(shape=s, batch=1, variant="cublas", us=us, weight_mib=mib)
            for s, us, mib in (("qkv", 10.0, 1.0), ("o", 5.0, 1.0), ("gate_up", 20.0, 1.0), ("down", 10.0, 1.0),
                               ("lm_head", 100.0, 1.0))]
    picks = {r["shape"]: {1: dict(us=r["us"] / 2)} for r in rows}
    note = step_note("tiny-llama", picks, rows, read_bytes_per_s=2**20 * 1e6)  # 1 MiB per us
    assert "cuBLAS 0.190 ms, picks 0.095 ms, read floor 0.009 ms" in note  # 2 layers x 45 us + 100 us


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_gemm_suite_refuses_to_time_without_cuda():
    from bench import gemm
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gemm.run("tiny-llama")


def test_gemm_report_shows_the_best_valid_triton_config_and_picks_the_fastest_variant(monkeypatch):
    """The suite's bookkeeping over stand-in timings: a wrong or failed Triton config is never shown
    nor picked, the fastest valid variant is, and every row's bandwidth is bytes over time."""
    from bench import gemm
    from bench.measure import Ceilings

    def fake_measure(n, k, batch, l2_bytes, configs=gemm.CONFIGS):
        fast = 5.0 if (n, k) == (128, 64) else 50.0   # the Triton kernel wins only on tiny-llama's qkv
        return [dict(variant="cublas", config="-", us=10.0, rel_err=0.0),
                dict(variant="cublas_fp32_reduce", config="-", us=11.0, rel_err=0.0),
                dict(variant="cublaslt", config="-", us=9.0, rel_err=0.0),
                dict(variant="triton_gemv", config="wrong", us=1.0, rel_err=0.5),
                dict(variant="triton_gemv", config="failed", us=None, rel_err=None, error="OutOfResources"),
                dict(variant="triton_gemv", config="good", us=fast, rel_err=1e-3)]

    monkeypatch.setattr(gemm, "_require_cuda", lambda: None)
    monkeypatch.setattr(gemm, "measure_ceilings", lambda: Ceilings(2e12, 1e15, "fake"))
    monkeypatch.setattr(gemm, "read_bytes_per_s", lambda: 4e12)
    monkeypatch.setattr(gemm, "l2_cache_bytes", lambda: 1 << 20)
    monkeypatch.setattr(gemm, "measure_shape", fake_measure)
    report = gemm.run("tiny-llama", batches="1")
    picks = report.meta["picks"]
    assert picks["qkv"][1]["variant"] == "triton_gemv" and picks["qkv"][1]["config"] == "good"
    assert picks["o"][1]["variant"] == "cublaslt" and picks["o"][1]["speedup_vs_cublas"] == pytest.approx(10 / 9)
    assert not any(r["config"] in ("wrong", "failed") for r in report.rows)
    qkv = next(r for r in report.rows if r["shape"] == "qkv" and r["variant"] == "cublas")
    assert qkv["gbps"] == pytest.approx((128 * 64 + 64 + 128) * 2 / 10e-6 / 1e9)
    assert qkv["x_read"] == pytest.approx(qkv["gbps"] * 1e9 / 4e12)
    assert any("failed" in note for note in report.notes) and "picks" in report.notes[-1]


@pytest.mark.gpu
def test_gemm_shape_measures_every_variant_and_agrees_with_cublas():
    from bench.gemm import CONFIGS, measure_shape
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    results = measure_shape(1536, 1152, 8, l2, configs=CONFIGS[:4])
    assert {r["variant"] for r in results} == {"cublas", "cublas_fp32_reduce", "cublaslt", "triton_gemv"}
    assert all(r["us"] > 0 and r["rel_err"] < 2e-2 for r in results)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # settings restored
