"""What runs a scheduled step on the device: the start-up sequence that builds it (startup.py, timed by
timeline.py; compile.py / compile_cache.py for the torch.compile side), the model runner and its static
input buffers (model_runner.py), the dispatcher that picks FULL / PIECEWISE / NONE (dispatch.py) and
the native decode graphs (decode_graphs.py)."""
