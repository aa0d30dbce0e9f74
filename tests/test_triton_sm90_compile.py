"""The GPU build of the split-K kernels, checked on a machine without a GPU.

The interpreter runs the kernels' logic on the CPU but never lowers them: an op the GPU compiler
rejects (an atomic's semantics, a cache modifier, a layout) would first fail on the GPU machine.
Here Triton compiles them (and the prefill kernel with its fused K/V store) for an H100 (sm_90)
ahead of time, in a subprocess without TRITON_INTERPRET (the kernels must be defined as compilable
functions), and the PTX is checked for what the one-launch split merge relies on: an
acquire-release arrival, a counter reset, L2 (.cg) reads of the partials. Skipped where a GPU exists (the gpu-marked tests run the real kernels there).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real kernels instead")

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = r'''
import json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:
    print(json.dumps({"skip": f"no ahead-of-time Triton API: {exc}"})); sys.exit(0)
from custom_ops import triton_decode, triton_gemv

def ptx(fn, signature, constexprs, **options):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["ptx"]

GEMV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "arrivals_ptr": "*i32",
        **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}}
DECODE = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", block_tables_ptr="*i32", seq_lens_ptr="*i32",
              out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
              arrivals_ptr="*i32", k_new_ptr="*bf16", v_new_ptr="*bf16", slot_ptr="*i64", scale="fp32",
              softcap="fp32", cos_ptr="*bf16", sin_ptr="*bf16", q_norm_ptr="*bf16", k_norm_ptr="*bf16",
              norm_eps="fp32", **{name: "i32" for name in (
                  "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ko", "stride_kh",
                  "stride_vb", "stride_vo", "stride_vh", "stride_bt", "stride_knt", "stride_knh", "stride_vnt",
                  "stride_vnh", "num_stores", "num_splits", "window", "stride_cos", "stride_sin")})
out = {}
try:
    for block_m, split_k, pdl, gate in ((1, 4, False, 0), (8, 1, False, 0), (16, 4, False, 0), (1, 1, True, 0),
                                        (1, 4, True, 0), (1, 4, True, 1), (1, 1, True, 2)):
        out[f"gemv-m{block_m}-s{split_k}" + ("-pdl" if pdl else "") + (f"-gate{gate}" if gate else "")] = ptx(
            triton_gemv._gemv_kernel, GEMV, dict(
                BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k, USE_DOT=block_m >= 16,
                DOT_PRECISION="tf32", PDL=pdl, GATE=gate, SCALED=False), num_warps=4, num_stages=3, launch_pdl=pdl)
    for block_m, split_k, gate in ((1, 1, 0), (1, 4, 1), (16, 1, 0)):  # FP8 weights (custom_ops.fp8)
        out[f"gemv-fp8-m{block_m}-s{split_k}" + (f"-gate{gate}" if gate else "")] = ptx(
            triton_gemv._gemv_kernel, dict(GEMV, w_ptr="*fp8e4nv"), dict(
                BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k, USE_DOT=block_m >= 16,
                DOT_PRECISION="tf32", PDL=True, GATE=gate, SCALED=True), num_warps=4, num_stages=3, launch_pdl=True)
    from custom_ops import triton_gemv_rope, triton_skinny
    SKINNY = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
              "arrivals_ptr": "*i32", "keys_ptr": "*i64",
              **{name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}}
    for block_n, split_k in ((64, 1), (16, 4)):  # the weight on the MMA's left, and x there
        out[f"skinny-fp8-n{block_n}-s{split_k}"] = ptx(triton_skinny._skinny_kernel, SKINNY, dict(
            BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split_k, EVEN_K=True, W_LEFT=block_n >= 64,
            DOT_PRECISION="tf32", PDL=True, KEYS=False, SCALED=True, PREFETCH_LINES=0, LINE=128),
            num_warps=4, num_stages=4, launch_pdl=True)
    for block_n, split_k, even_k, lines in ((64, 1, True, 0), (16, 4, False, 0), (64, 1, True, 8), (16, 4, False, 2)):
        # bf16, as decode batches and verify steps run it; `lines`: the L2 prefetch (INFER_GRAPHS_SKINNY_PREFETCH)
        out[f"skinny-n{block_n}-s{split_k}" + ("" if even_k else "-uneven") + (f"-prefetch{lines}" if lines else "")] = ptx(
            triton_skinny._skinny_kernel, dict(SKINNY, w_ptr="*bf16"), dict(
                BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split_k, EVEN_K=even_k, W_LEFT=block_n >= 64,
                DOT_PRECISION="tf32", PDL=True, KEYS=split_k == 1, SCALED=False, PREFETCH_LINES=lines, LINE=64),
            num_warps=4, num_stages=4, launch_pdl=True)
    ROPE_GEMV = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                 "qkv_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32"}
    out["gemv-rope-fp8"] = ptx(triton_gemv_rope._gemv_rope_kernel, ROPE_GEMV, dict(
        NUM_Q_HEADS=24, NUM_HEADS=32, HEAD_DIM=128, HALF=64, HALF_N=4, BLOCK_K=512, PDL=True, SCALED=True),
        num_warps=4, num_stages=3, launch_pdl=True)
    for splits, pdl, rope in ((1, False, False), (8, False, False), (8, True, False), (8, True, True)):
        out[f"decode-s{splits}" + ("-pdl" if pdl else "") + ("-rope" if rope else "")] = ptx(
            triton_decode._decode_kernel, DECODE, dict(
                NUM_HEADS=24, NUM_KV_HEADS=8, GROUP=3, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                PAGE_SIZE=16, SPLIT=splits > 1, SOFTCAP=True, WINDOW=True, DOT_PRECISION="tf32",
                FUSE_STORE=True, ROPE=rope, QK_NORM=rope, UNIT_OFFSET=rope, PDL=pdl),
            num_warps=4, num_stages=2, launch_pdl=pdl)
    from custom_ops import triton_prefill
    PREFILL = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", block_tables_ptr="*i32",
                   query_start_loc_ptr="*i32", seq_lens_ptr="*i32", k_new_ptr="*bf16", v_new_ptr="*bf16",
                   slot_ptr="*i64", scale="fp32", softcap="fp32", **{name: "i32" for name in (
                       "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ko", "stride_kh",
                       "stride_vb", "stride_vo", "stride_vh", "stride_bt", "stride_knt", "stride_knh",
                       "stride_vnt", "stride_vnh", "num_stores", "dense_len", "pad_start", "pad_end", "window",
                       "num_seqs")})
    out["prefill-fused-store"] = ptx(triton_prefill._prefill_kernel, PREFILL, dict(
        GROUP=3, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, PAGE_SIZE=16, PAGED=True,
        SOFTCAP=False, WINDOW=False, DOT_PRECISION="tf32", FUSE_STORE=True, PAD_START_ON_DEVICE=False,
        BLOCK_S=16), num_warps=4, num_stages=2)
    out["prefill-pad-on-device"] = ptx(triton_prefill._prefill_kernel, PREFILL, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=32, PAGE_SIZE=16, PAGED=True,
        SOFTCAP=False, WINDOW=True, DOT_PRECISION="tf32", FUSE_STORE=True, PAD_START_ON_DEVICE=True,
        BLOCK_S=16), num_warps=8, num_stages=3)
    from custom_ops import triton_rms_norm, triton_rope
    NORM = dict(h_ptr="*bf16", delta_ptr="*bf16", weight_ptr="*bf16", delta_weight_ptr="*bf16", sum_ptr="*bf16",
                out_ptr="*bf16", eps="fp32", **{name: "i32" for name in (
                    "stride_h", "stride_delta", "stride_sum", "stride_out", "hidden")})
    out["add-rms-norm-branch-pdl"] = ptx(triton_rms_norm._add_rms_norm_kernel, NORM, dict(
        UNIT_OFFSET=True, DELTA_NORM=True, BLOCK=2048, PDL=True), num_warps=4, launch_pdl=True)
    ROPE = dict(q_in_ptr="*bf16", k_in_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_weight_ptr="*bf16",
                k_weight_ptr="*bf16", q_ptr="*bf16", k_ptr="*bf16", eps="fp32", v_ptr="*bf16", k_cache_ptr="*bf16",
                v_cache_ptr="*bf16", slot_ptr="*i64", **{name: "i32" for name in (
                    "stride_q_in", "stride_k_in", "stride_cos", "stride_sin", "stride_q", "stride_k", "stride_v",
                    "stride_cb", "stride_co", "stride_ch", "num_store")})
    for store in (False, True):  # with the verify step's K/V store in the same launch
        out["qk-norm-rope-pdl" + ("-store" if store else "")] = ptx(triton_rope._qk_norm_rope_kernel, ROPE, dict(
            NUM_Q_HEADS=32, NUM_HEADS=40, HEAD_DIM=128, HALF=64, BLOCK_H=4, BLOCK_HALF=64, NORM=True,
            UNIT_OFFSET=False, PDL=True, STORE=store, PAGE_SIZE=16), num_warps=4, launch_pdl=True)
    from custom_ops import triton_argmax
    VERIFY = dict(keys_ptr="*i64", index_ptr="*i64", proposals_ptr="*i64", out_ptr="*i64", num_tiles="i32",
                  stride_p="i32")
    out["verify-keys"] = ptx(triton_argmax._verify_keys_kernel, VERIFY, dict(WIDTH=5, BLOCK_W=8, BLOCK=256),
                             num_warps=4)
    ACT = dict(x_ptr="*bf16", out_ptr="*bf16", K="i32", stride_xm="i32", stride_om="i32")
    out["act-mul-pdl"] = ptx(triton_gemv._act_mul_kernel, ACT, dict(BLOCK=1024, GATE=2, PDL=True),
                             num_warps=4, launch_pdl=True)
except (RuntimeError, FileNotFoundError) as exc:
    if "ptxas" in str(exc):
        print(json.dumps({"skip": f"no ptxas in this Triton install: {exc}"})); sys.exit(0)
    raise
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"sm_90 compile failed:\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def assert_one_launch_merge(ptx: str) -> None:
    assert "atom.global.gpu.acq_rel.add" in ptx      # the arrival releases the partials, acquires the others'
    assert "atom.global.gpu.acq_rel.exch" in ptx     # the last arriver resets the counter
    assert "ld.global.cg" in ptx                     # partials read from L2, never a stale L1 line


@pytest.mark.parametrize("name", ["gemv-m1-s4", "gemv-m16-s4", "decode-s8", "gemv-m1-s4-pdl", "decode-s8-pdl",
                                  "gemv-m1-s4-pdl-gate1", "decode-s8-pdl-rope"])
def test_split_kernels_build_for_sm90_with_a_one_launch_merge(sm90_ptx, name):
    assert_one_launch_merge(sm90_ptx[name])


@pytest.mark.parametrize("name", ["gemv-m8-s1", "decode-s1"])
def test_unsplit_kernels_build_for_sm90_without_atomics(sm90_ptx, name):
    assert ".entry" in sm90_ptx[name] and "atom.global" not in sm90_ptx[name]


@pytest.mark.parametrize("name", ["prefill-fused-store", "prefill-pad-on-device"])
def test_prefill_with_the_fused_store_builds_for_sm90(sm90_ptx, name):
    """The prefill kernel with the K/V store in its launch (FUSE_STORE), and with the padding rows'
    start read on the device (a mixed-step graph's launch), lowers for the GPU."""
    assert ".entry" in sm90_ptx[name] and "st.global" in sm90_ptx[name]


def _first(ptx: str, needle: str) -> int:
    at = ptx.find(needle)
    assert at >= 0, f"{needle!r} not in the PTX"
    return at


@pytest.mark.parametrize("name", ["gemv-m1-s1-pdl", "gemv-m1-s4-pdl", "decode-s8-pdl", "decode-s8-pdl-rope",
                                  "gemv-m1-s4-pdl-gate1",
                                  "gemv-m1-s1-pdl-gate2", "add-rms-norm-branch-pdl", "qk-norm-rope-pdl",
                                  "qk-norm-rope-pdl-store", "act-mul-pdl", "skinny-n64-s1", "skinny-n16-s4-uneven"])
def test_pdl_kernels_wait_for_the_previous_kernel_before_any_store(sm90_ptx, name):
    """Under programmatic dependent launch a kernel may run while the previous one still writes its
    input: every store (and every atomic) must come after the grid-dependency wait, and the kernel lets
    its successor be scheduled (launch_dependents)."""
    ptx = sm90_ptx[name]
    wait = _first(ptx, "griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in ptx
    assert _first(ptx, "st.global") > wait
    if "atom.global" in ptx:
        assert _first(ptx, "atom.global") > wait


@pytest.mark.parametrize("name", ["gemv-fp8-m1-s1", "gemv-fp8-m1-s4-gate1", "gemv-fp8-m16-s1", "skinny-fp8-n64-s1",
                                  "skinny-fp8-n16-s4", "gemv-rope-fp8"])
def test_fp8_weight_gemv_builds_for_sm90_and_waits_before_storing(sm90_ptx, name):
    """The GEMV over float8_e4m3fn weights (custom_ops.fp8) lowers for the GPU, converting the FP8
    values in registers, and keeps the PDL contract of the bf16 kernel."""
    ptx = sm90_ptx[name]
    assert "cvt" in ptx and "e4m3" in ptx
    assert _first(ptx, "st.global") > _first(ptx, "griddepcontrol.wait")


def test_the_rotary_with_the_verify_steps_store_and_the_one_launch_greedy_verify_build_for_sm90(sm90_ptx):
    """The q/k norm + rotary launch that also stores a verify step's K/V writes the cache (more stores
    than without), and the greedy verify over the keys lowers with its scan, neither yet run on a GPU."""
    assert sm90_ptx["qk-norm-rope-pdl-store"].count("st.global") > sm90_ptx["qk-norm-rope-pdl"].count("st.global")
    assert "st.global" in sm90_ptx["verify-keys"] and "griddepcontrol" not in sm90_ptx["verify-keys"]


def test_the_batch1_gemv_loads_its_first_weight_tile_before_the_wait(sm90_ptx):
    """The weights are the layer's own, not the previous kernel's output: at least one global load is
    issued before the wait, so the weight stream starts while the previous kernel finishes."""
    ptx = sm90_ptx["gemv-m1-s1-pdl"]
    assert 0 <= ptx.find("ld.global") < _first(ptx, "griddepcontrol.wait")




@pytest.mark.parametrize("name", ["skinny-n64-s1-prefetch8", "skinny-n16-s4-uneven-prefetch2"])
def test_the_skinny_gemms_l2_prefetch_comes_before_the_wait_and_leaves_the_loop_alone(sm90_ptx, name):
    """With INFER_GRAPHS_SKINNY_PREFETCH the weight lines are asked of L2 before the wait (no load into
    registers there: that broke a tl.dot loop's pipelining before), and the rest is the kernel without it."""
    ptx, plain = sm90_ptx[name], sm90_ptx[name.rsplit("-prefetch", 1)[0]]
    wait = _first(ptx, "griddepcontrol.wait")
    assert _first(ptx, "prefetch.global.L2") < wait and "prefetch" not in plain
    assert ptx[:wait].count("ld.global") == plain[:_first(plain, "griddepcontrol.wait")].count("ld.global")
    assert _first(ptx, "st.global") > wait


@pytest.mark.parametrize("name", ["gemv-m1-s4", "gemv-m16-s4", "decode-s8"])
def test_kernels_built_without_pdl_have_no_grid_dependency_control(sm90_ptx, name):
    assert "griddepcontrol" not in sm90_ptx[name]


def test_decode_with_qk_norms_loads_the_norm_weights_before_the_wait(sm90_ptx):
    """The q/k norm weights are the layer's own: loaded while the projection before still runs."""
    def loads_before_wait(ptx: str) -> int:
        return ptx[:_first(ptx, "griddepcontrol.wait")].count("ld.global")
    # the sequence length is read before the wait in both (the step's metadata is copied in first)
    assert loads_before_wait(sm90_ptx["decode-s8-pdl-rope"]) > loads_before_wait(sm90_ptx["decode-s8-pdl"])
