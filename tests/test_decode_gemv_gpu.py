"""The batch-1 decode GEMV (EngineConfig.decode_gemv) on CUDA.

Op level: `torch.ops.infer.linear` runs the Triton GEMV for every shape of the measured table at one
row (bf16 and fp16, with and without bias) and equals x.float() @ W.float().T within the dtype's
rounding; at two rows it is F.linear exactly; captured in a CUDA graph at one row, it replays the
GEMV (split-K included) on fresh inputs.

Engine level: a 2-layer model with llama-3.2-3b's real shapes (so every matmul of a decode step and
the tied-embedding LM head is in the table), decode graphs on, greedy generation at batch 1 with
the switch off and on. The GEMV rounds differently from cuBLAS, and with 128k random-weight logits a
near-tie may flip a token, so exact equality of on and off would be a flaky test. Instead every
generated token, of both engines, must be the argmax of a float32 copy of the model fed the same
tokens (teacher forcing) up to 0.2 standard deviations of that position's logits: bf16 rounding
moves a logit by a few hundredths of one, a wrong kernel, a stale input or a lost write by several. The
engine with the switch on must also have recorded the GEMV for all five of its shapes in the table
(the table also holds other models' shapes) in its captures, and the one with it off none.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import custom_ops.triton_gemv
import custom_ops.triton_gemv_rope
import models
from bench.configs import LLAMA_3_2_3B
from custom_ops import GEMV_CONFIGS, gemv_config
from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # as tests/test_triton_gemv.py, against float32 here
# This model's bf16 logits differ from float32's by at most 0.06 standard deviations of a row
# (measured on the CPU); a wrong token is typically 3-5 below the max.
LOGIT_GAP_STDS = 0.2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture
def gemv_calls(monkeypatch):
    """(N, K, capturing) of every GEMV launch (the op imports the kernel at each call: this spy)."""
    calls = []
    real = custom_ops.triton_gemv.gemv
    real_rope = custom_ops.triton_gemv_rope.gemv_rope

    def spy(x, weight, config=None, out=None, gate=None):
        calls.append((weight.shape[0], weight.shape[1], torch.cuda.is_current_stream_capturing()))
        return real(x, weight, config, out, gate)

    def spy_rope(x, weight, *args):  # the q/k/v projection of a layer without q/k norms (Llama)
        calls.append((weight.shape[0], weight.shape[1], torch.cuda.is_current_stream_capturing()))
        return real_rope(x, weight, *args)
    monkeypatch.setattr(custom_ops.triton_gemv, "gemv", spy)
    monkeypatch.setattr(custom_ops.triton_gemv_rope, "gemv_rope", spy_rope)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_linear_op_runs_the_gemv_for_every_table_shape_at_one_row(gemv_calls, dtype):
    failures = []
    for (n, k), config in GEMV_CONFIGS.items():
        weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype)
        for b in (None, bias):
            x = torch.randn(1, k, device="cuda").to(dtype)
            gemv_calls.clear()
            y = torch.ops.infer.linear(x, weight, b)
            reference = x.float() @ weight.float().t() + (0 if b is None else b.float())
            assert gemv_calls == [(n, k, False)], f"({n}, {k}) at one row did not run the GEMV"
            assert y.shape == (1, n) and y.dtype == dtype
            err = rel_err(y, reference)
            if not err < TOL[dtype]:
                failures.append(f"({n}, {k}) {config.label()} bias={b is not None}: rel err {err:.2e}")
        x2 = torch.randn(2, k, device="cuda").to(dtype)
        gemv_calls.clear()
        y2 = torch.ops.infer.linear(x2, weight, bias)
        assert gemv_calls == []  # two rows: never the GEMV
        if gemv_config(2, n, k, dtype, "cuda") is None:  # cuBLAS, as F.linear runs it
            assert torch.equal(y2, F.linear(x2, weight, bias))
        else:  # the skinny GEMM's choice for 2-8 rows
            err = rel_err(y2, x2.float() @ weight.float().t() + bias.float())
            if not err < TOL[dtype]:
                failures.append(f"({n}, {k}) at two rows: rel err {err:.2e}")
        del weight
    assert not failures, "\n".join(failures)


def test_gpu_linear_op_captured_at_one_row_replays_the_split_k_gemv_on_fresh_inputs(gemv_calls):
    n, k = next(shape for shape, config in GEMV_CONFIGS.items() if config.split_k > 1)
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.infer.linear(x, weight, None)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.infer.linear(x, weight, None)
    assert gemv_calls[-1] == (n, k, True)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, x.float() @ weight.float().t()) < TOL[torch.bfloat16]


def test_gpu_linear_rope_is_one_launch_for_llamas_projection_eager_and_replayed(gemv_calls):
    """llama-3.2-3b's q/k/v projection at one row: the GEMV with the rotary in its epilogue, against
    float32; its q and k within one bf16 rounding of the rotary kernel applied to its own qkv; captured,
    it replays on fresh inputs and a new position."""
    from custom_ops import apply_rotary, run_qk_norm_rope
    n, k, hq, hkv, d = 5120, 3072, 24, 8, 128
    weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    cos, sin = torch.empty(1, d // 2, device="cuda", dtype=torch.bfloat16), torch.empty_like(inv_freq[None]).bfloat16()

    def set_position(p: int) -> None:
        cos.copy_((p * inv_freq).cos()[None])
        sin.copy_((p * inv_freq).sin()[None])

    def check(qkv, q, kk) -> None:
        want = x.float() @ weight.float().t()
        assert rel_err(qkv, want) < TOL[torch.bfloat16]
        heads = want[:, :(hq + hkv) * d].view(1, hq + hkv, d)
        rotated = apply_rotary(heads, cos.float()[:, None], sin.float()[:, None])
        assert rel_err(q, rotated[:, :hq]) < TOL[torch.bfloat16] and rel_err(kk, rotated[:, hq:]) < TOL[torch.bfloat16]
        q2, k2 = run_qk_norm_rope(qkv, cos, sin, None, None, 0.0, False, hq, hkv)
        torch.testing.assert_close(q, q2, rtol=8e-3, atol=1e-3)
        torch.testing.assert_close(kk, k2, rtol=8e-3, atol=1e-3)

    set_position(1234)
    check(*torch.ops.infer.linear_rope(x, weight, None, cos, sin, hq, hkv))
    assert gemv_calls == [(n, k, False)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = torch.ops.infer.linear_rope(x, weight, None, cos, sin, hq, hkv)
    assert gemv_calls[-1] == (n, k, True)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        set_position(17 + 1000 * seed)
        graph.replay()
        torch.cuda.synchronize()
        check(*outs)


DOWN_SHAPES = [(3072, 8192), (2560, 9728), (1152, 6912)]  # llama-3.2-3b, qwen3-4b, gemma-3-1b


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_gated_linear_runs_the_activation_inside_the_gemv_at_one_row_and_in_a_graph(gemv_calls, activation):
    """Each model's down projection at one row: the GEMV with act(gate) * up in its loads, against
    float32 from the same bf16-rounded activation; at two rows one act-and-multiply launch and cuBLAS;
    captured at one row, the graph replays it on fresh inputs."""
    from custom_ops.linear import act_and_mul_plain
    for n, k in DOWN_SHAPES:
        assert (n, k) in GEMV_CONFIGS
        weight = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
        gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        gemv_calls.clear()
        y = torch.ops.infer.gated_linear(gate_up, weight, activation)
        assert gemv_calls == [(n, k, False)]
        assert rel_err(y, act_and_mul_plain(gate_up, activation).float() @ weight.float().t()) < TOL[torch.bfloat16]
        rows = torch.randn(2, 2 * k, device="cuda", dtype=torch.bfloat16)
        gemv_calls.clear()
        y2 = torch.ops.infer.gated_linear(rows, weight, activation)
        assert gemv_calls == []
        assert rel_err(y2, act_and_mul_plain(rows, activation).float() @ weight.float().t()) < TOL[torch.bfloat16]

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g = torch.ops.infer.gated_linear(gate_up, weight, activation)
        gate_up.copy_(torch.randn_like(gate_up))
        graph.replay()
        assert rel_err(g, act_and_mul_plain(gate_up, activation).float() @ weight.float().t()) < TOL[torch.bfloat16]


# ------------------------------------------------------------------------------------- engine

def test_gpu_linear_op_runs_every_many_row_choice_of_the_table(monkeypatch):
    """At 2-64 rows the op runs the table's choice (the skinny GEMM or cuBLASLt) for each of its
    shapes, at the bucket's own row count and at the smallest count inside it, and equals float32."""
    import custom_ops.linear
    from custom_ops.gemv_table import SKINNY_CONFIGS
    ran = []
    real = custom_ops.linear.matmul_rows
    monkeypatch.setattr(custom_ops.linear, "matmul_rows",
                        lambda x, weight, choice, out=None: ran.append(choice) or real(x, weight, choice, out))
    for (n, k), by_rows in SKINNY_CONFIGS.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for bucket, choice in by_rows.items():
            for rows in sorted({bucket, bucket // 2 + 1} | ({2} if bucket == 8 else set())):  # 8: from 2 rows
                ran.clear()
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                y = torch.ops.infer.linear(x, weight, None)
                assert ran == [choice], (n, k, rows)
                assert rel_err(y, x.float() @ weight.float().t()) < TOL[torch.bfloat16], (n, k, rows, choice)
        del weight


# Untied: the LM head has the tied embedding's shape (128256, 3072), but a random model with tied
# embeddings only ever repeats its last token (the largest logit is that token's own embedding), which
# would pass with most of the step broken.
CONFIG = {**LLAMA_3_2_3B, "num_hidden_layers": 2, "tie_word_embeddings": False}
PROMPTS = [[128000, 791, 4062, 14198, 39935], [128000, 40, 1093]]
MAX_TOKENS = 8
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, block_size=16, num_gpu_blocks=16,
              decode_graph_sizes=(1, 2), show_progress=False)


def _generate(net: torch.nn.Module, decode_gemv: bool) -> tuple[list[list[int]], dict]:
    torch._dynamo.reset()  # every LLM compiles its own model with its own backend instance
    with LLM(net, decode_gemv=decode_gemv, **ENGINE) as llm:
        # one prompt at a time: every decode step is a batch of 1, the GEMV's graph
        tokens = [llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
                  for p in PROMPTS]
        stats = llm.stats()
    torch._dynamo.reset()
    return tokens, stats


def _far_from_argmax(reference: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[str]:
    """Generated tokens whose float32 teacher-forced logit is more than LOGIT_GAP_STDS below the max."""
    ids = torch.tensor(prompt + tokens[:-1], device="cuda")
    with torch.no_grad():
        logits = reference.compute_logits(reference(ids, torch.arange(len(ids), device="cuda")))
    bad = []
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        gap = float(row.max() - row[token])
        if gap > LOGIT_GAP_STDS * float(row.std()):
            bad.append(f"token {i} ({token}): {gap:.3f} below the max {int(row.argmax())}, std {float(row.std()):.3f}")
    return bad


def _matmul_shapes(net: torch.nn.Module) -> set[tuple[int, int]]:
    """(N, K) of every weight a decode step multiplies by: the 2-D parameters (the embedding has the
    LM head's shape)."""
    return {tuple(p.shape) for p in net.parameters() if p.dim() == 2}


def test_gpu_engine_with_decode_gemv_generates_float32_greedy_tokens_from_gemv_graphs(gemv_calls):
    net = models.from_config(CONFIG, dtype="bfloat16", device="cuda", seed=0)
    reference = models.from_config(CONFIG, dtype="float32", device="cuda")
    reference.load_state_dict(net.state_dict())  # the same weights, in float32

    tokens_off, stats_off = _generate(net, False)
    assert gemv_calls == []
    tokens_on, stats_on = _generate(net, True)
    captured = {(n, k) for n, k, capturing in gemv_calls if capturing}
    llama_shapes = {shape for shape in GEMV_CONFIGS if shape in _matmul_shapes(net)}
    assert len(llama_shapes) == 5  # q/k/v, o, gate/up, down and the tied LM head
    assert captured == llama_shapes, f"shapes the decode graphs recorded on the GEMV: {sorted(captured)}"
    for stats in (stats_off, stats_on):
        assert stats["fallbacks"] == 0 and stats["decode_graph_replays_by_size"].get(1, 0) >= MAX_TOKENS

    failures = []
    for name, tokens in (("off", tokens_off), ("on", tokens_on)):
        for prompt, out in zip(PROMPTS, tokens):
            assert len(out) == MAX_TOKENS
            failures += [f"decode_gemv {name}, prompt {prompt}: {line}" for line in _far_from_argmax(reference, prompt, out)]
    assert not failures, "\n".join(failures)


BATCH_ENGINE = dict(max_model_len=64, max_num_seqs=64, max_num_batched_tokens=512, block_size=16,
                    num_gpu_blocks=96, decode_graph_sizes=(64,), show_progress=False)


def test_gpu_engine_at_batch_64_replays_the_tables_many_row_choices_and_generates_float32_greedy_tokens(monkeypatch):
    """64 prompts at once: the decode graph of 64 rows records the skinny GEMM / cuBLASLt for exactly
    the table's shapes at 64 rows (custom_ops.gemv_table.SKINNY_CONFIGS), and its tokens are the
    float32 model's argmax as in the batch-1 test above."""
    import custom_ops.linear
    from custom_ops.gemv_table import SKINNY_CONFIGS
    calls = []
    real = custom_ops.linear.matmul_rows

    def spy(x, weight, choice, out=None, keys=None):
        calls.append((weight.shape[0], weight.shape[1], x.shape[0], torch.cuda.is_current_stream_capturing()))
        return real(x, weight, choice, out, keys)
    monkeypatch.setattr(custom_ops.linear, "matmul_rows", spy)

    net = models.from_config(CONFIG, dtype="bfloat16", device="cuda", seed=0)
    reference = models.from_config(CONFIG, dtype="float32", device="cuda")
    reference.load_state_dict(net.state_dict())
    generator = torch.Generator().manual_seed(0)
    prompts = [[128000] + torch.randint(100, 120000, (3 + i % 6,), generator=generator).tolist() for i in range(64)]
    torch._dynamo.reset()
    with LLM(net, decode_gemv=True, **BATCH_ENGINE) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        stats = llm.stats()
    torch._dynamo.reset()
    assert stats["fallbacks"] == 0 and stats["decode_graph_replays_by_size"].get(64, 0) >= 3
    expected = {shape for shape, by_rows in SKINNY_CONFIGS.items() if 64 in by_rows and shape in _matmul_shapes(net)}
    assert expected, "the table has no 64-row choice for llama-3.2-3b's shapes"
    assert {(n, k) for n, k, rows, capturing in calls if capturing and rows == 64} == expected
    failures = []
    for prompt, out in list(zip(prompts, outputs))[:8]:
        assert len(out.token_ids) == 4
        failures += [f"prompt {prompt}: {line}" for line in _far_from_argmax(reference, prompt, out.token_ids)]
    assert not failures, "\n".join(failures)
