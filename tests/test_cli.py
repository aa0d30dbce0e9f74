"""The command line: mistakes are one `error:` line naming the flag, refused before the model loads
where the model is not needed to see them; the `infer-graphs` console script is the same main."""
from __future__ import annotations

import configparser
import importlib
from pathlib import Path

import pytest
import torch
import transformers

import engine
from engine.entrypoints import cli
from tests.tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to build an engine fails the test: these mistakes must be seen before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was refused")
    monkeypatch.setattr(engine, "LLM", refuse)


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "0"], "error: --max-tokens 0 is invalid: expected an int >= 1"),
    (["--temperature", "-1"], "error: --temperature -1.0 is invalid: expected a finite number >= 0"),
    (["--top-p", "1.5"], "error: --top-p 1.5 is invalid: expected a number in (0, 1]"),
    (["--top-k", "-3"], "error: --top-k -3 is invalid"),
    (["--prompt", ""], "error: --prompt is empty"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs 0 is invalid: expected an int >= 1"),
    (["--kv-memory-fraction", "2"], "error: --kv-memory-fraction 2.0 is invalid"),
    (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization 1.5 is invalid"),
    (["--quantization", "int4"], "error: --quantization 'int4' is invalid: expected None or one of fp8"),
])
def test_a_mistake_is_refused_before_the_model_loads_naming_the_flag(no_model_load, capsys, flags, message):
    argv = ["generate", "--model", "/nonexistent/never-read", "--prompt", "hi", *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("value,max_tokens", [("none", None), ("None", None), ("7", 7)])
def test_max_tokens_none_generates_until_eos_or_max_model_len(value, max_tokens):
    args = cli.build_parser().parse_args(["generate", "--model", "m", "--prompt", "hi", "--max-tokens", value])
    assert args.max_tokens == max_tokens
    cli._check_before_loading(args)  # what the engine would be given
    assert args.params.max_tokens == max_tokens


def test_max_tokens_that_is_neither_an_int_nor_none_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt", "hi", "--max-tokens", "lots"])
    assert info.value.code == 2
    assert "--max-tokens: 'lots' is neither an int nor none" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_says_to_use_device_cpu(no_model_load, capsys):
    assert cli.main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "error: --device cuda: no CUDA device is visible to torch here; use --device cpu" in capsys.readouterr().err


def test_serve_refuses_a_bad_engine_option_before_loading(no_model_load, capsys):
    assert cli.main(["serve", "--model", "/nonexistent", "--block-size", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --block-size 0 is invalid")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_quantization_fp8_reaches_the_engine_config_from_both_commands(command):
    args = cli.build_parser().parse_args([*command, "--model", "m", "--quantization", "fp8"])
    assert cli.engine_config_fields(args)["quantization"] == "fp8"


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_disable_custom_all_reduce_reaches_the_engine_config_from_both_commands(command):
    args = cli.build_parser().parse_args([*command, "--model", "m", "--disable-custom-all-reduce"])
    assert cli.engine_config_fields(args)["disable_custom_all_reduce"] is True
    assert "disable_custom_all_reduce" not in cli.engine_config_fields(cli.build_parser().parse_args([*command]))


def test_an_unknown_flag_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt", "hi", "--max-tokns-typo", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --max-tokns-typo" in capsys.readouterr().err


def test_a_missing_hub_model_is_refused_before_loading(no_model_load, capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["generate", "--model", "no-org/no-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model 'no-org/no-model' is not a local path, and not in the Hugging Face "
                          f"cache {tmp_path}")


def _tiny_model_dir(path: Path, max_position_embeddings: int = 64) -> Path:
    vocab = save_tiny_tokenizer(path)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings)).save_pretrained(path)
    return path


@pytest.mark.parametrize("limit_flags,limit", [(["--max-model-len", "16"], 16), ([], 64)])
def test_a_prompt_longer_than_the_context_is_refused_before_the_model_loads(no_model_load, tmp_path, capsys,
                                                                           limit_flags, limit):
    """Counted by the tokenizer alone; the context is --max-model-len, else the model's own limit."""
    model = _tiny_model_dir(tmp_path)
    argv = ["generate", "--model", str(model), "--prompt", "hi", "--prompt", "The capital of France is Paris. " * 12,
            *limit_flags, "--block-size", "4", "--no-compile", "--device", "cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --prompt has ") and err.endswith(f"tokens, longer than --max-model-len ({limit})"), err


def test_a_prompt_near_the_context_is_counted_once_and_the_engine_gets_the_tokenizer(tmp_path, monkeypatch, capsys):
    """A prompt whose bytes could exceed the context is counted early; if it fits, the engine is given
    the tokenizer that counted it instead of loading its own."""
    import models
    model = _tiny_model_dir(tmp_path)
    loads = []
    real_load = models.load_tokenizer
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: loads.append(a) or real_load(*a, **k))  # what
    # engine.core.tokenizer_load calls
    given = []
    monkeypatch.setattr(engine, "LLM", lambda model, tokenizer=None, **fields: given.append(tokenizer) or 1 / 0)
    prompt = "Paris " * 10  # 60 bytes: within 8 of the 64-token context, ~11 tokens
    with pytest.raises(ZeroDivisionError):
        cli.main(["generate", "--model", str(model), "--prompt", prompt, "--device", "cpu", "--no-compile"])
    assert len(loads) == 1 and given[0] is not None and len(given[0](prompt)["input_ids"]) <= 64
    given.clear()
    with pytest.raises(ZeroDivisionError):  # a short prompt: nothing loads before the engine
        cli.main(["generate", "--model", str(model), "--prompt", "hi", "--device", "cpu", "--no-compile"])
    assert len(loads) == 1 and given == [None]


def test_generate_on_the_cpu_prints_its_text_and_no_graph_counters(tmp_path, capsys):
    """The CPU has no graphs: the report ends at the tokens/s line (a GPU run adds its graphs' line)."""
    model = _tiny_model_dir(tmp_path)
    argv = ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "3", "--ignore-eos",
            "--block-size", "4", "--no-compile", "--device", "cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("hi") and "[3 tokens, finish: length" in out[1]
    assert out[-1].endswith("tokens/s") and not any(line.startswith("graphs:") for line in out), out


def test_engine_errors_are_put_in_the_flags_words():
    assert cli._in_flags("request '0.1': SamplingParams.top_k=-2 is invalid: expected an int") == \
        "--top-k -2 is invalid: expected an int"
    assert cli._in_flags("EngineConfig.max_model_len=0 is invalid") == "--max-model-len 0 is invalid"
    assert cli._in_flags("EngineConfig.model='' is invalid") == "EngineConfig.model='' is invalid"  # no flag


def test_the_console_script_is_the_cli_under_its_own_name(capsys, monkeypatch):
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in setup["options.entry_points"]["console_scripts"].split("\n") if line)
    module, func = scripts["infer-graphs"].split(":")
    entry = getattr(importlib.import_module(module), func)
    assert entry is cli.console_main
    monkeypatch.setattr("sys.argv", ["infer-graphs", "--help"])
    with pytest.raises(SystemExit) as info:
        entry()
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: infer-graphs") and "generate" in out and "serve" in out


def test_python_dash_m_engine_keeps_working():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m engine generate"), out.stderr
