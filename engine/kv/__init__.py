"""The KV cache: its memory (kv_cache.py), the block pools that hand it out (block_pool.py, and per
layer kind kv_groups.py / sliding_pool.py), the prefix cache over full blocks (prefix_cache.py) and the
device block tables that mirror the pools (block_tables.py). Knows requests only by id."""
