import shutil, sys, transformers
from tests.hf_helpers import random_hf_model
path = sys.argv[1]
config = transformers.LlamaConfig(vocab_size=262144, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=2, eos_token_id=1)
random_hf_model(config, seed=0).save_pretrained(path)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"bench/.tokenizer/{f}", path)
