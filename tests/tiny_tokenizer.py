"""A small real tokenizer for CPU tests: byte-level BPE trained by the `tokenizers` library on a few
sentences (English, accented, CJK, emoji), so multi-byte characters are split across tokens the way
a production byte-level tokenizer splits them; saved as a transformers tokenizer with a chat template.
"""
from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello world! How are you today? I am fine, thank you.",
    "Café crème, naïve façade, déjà vu, jalapeño, Zürich, Øresund.",
    "日本語のテキストと中文文本 are multi-byte characters.",
    "Emoji: 🙂 🚀 ✨ 👍🏽 and symbols € £ ¥ ° ± µ.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
SPECIAL = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_tokenizer(path: Path, vocab_size: int = 384) -> int:
    """Train and save the tokenizer into `path`; returns its vocabulary size (<= vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(fast)


def save_tiny_llama_with_tokenizer(path: Path, seed: int = 3) -> Path:
    """A 2-layer random-weight Llama whose vocabulary is the tiny tokenizer's, saved with it in `path`
    (eos is the tokenizer's <eos>, id 1)."""
    import transformers

    from tests.hf_helpers import random_hf_model

    vocab = save_tiny_tokenizer(path)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.5, pad_token_id=0,
        bos_token_id=2, eos_token_id=1)
    random_hf_model(config, seed=seed).save_pretrained(path)
    return path
