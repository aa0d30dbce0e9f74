"""The KV cache: its memory (kv_cache.py), the layers grouped by attention kind with the memory split
between the groups (groups.py), the block pools that hand the memory out (block_pool.py; per sliding
window sliding_pool.py; every group behind one interface grouped_pool.py), the prefix cache over full
blocks (prefix_cache.py) and the device block tables that mirror the pools (block_tables.py). Knows
requests only by id."""
