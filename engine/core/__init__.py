"""The engine core: the LLM API (llm.py), the one step loop (step_loop.py), the scheduler that owns
the running set and every finishing rule (scheduler.py), the text front end: incremental
detokenization, stop strings and the outputs (detokenizer.py), and the engine's counters (stats.py).
Imports kv/, worker/, sample/ and distributed/ below it; nothing below imports it."""
