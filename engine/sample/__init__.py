"""Sampling on the device: the sampler (sampler.py), the row argmax it chooses per vocabulary
(argmax.py) and the pinned ring that stages its per-row values without waiting (staging.py)."""
