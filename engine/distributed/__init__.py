"""Tensor parallelism: rank 0's launcher and leader (tp.py) and the loop every other rank runs,
receiving and running rank 0's steps (rank_loop.py)."""
