"""Speculative decoding (EngineConfig.speculative_config): more than one token per pass over the weights.

- config.py   SpeculativeConfig, parsed from vLLM's dict shape;
- ngram.py    prompt-lookup proposals from the request's own tokens;
- draft.py    draft-model proposals: a second model on the engine's own runner, KV pool and graphs;
- proposer.py which requests propose, the adaptive back-off, the counts (llm.stats()["spec_decode"]);
- verify.py   greedy and rejection-sampling verification, batched, on the device;
- sampling.py a verify step's tokens from its logits (plain chunks through the Sampler).

The step's path: the Scheduler appends proposals (all of a step's at once) to eligible decode chunks (a verify chunk of 1 + k
tokens), the runner computes logits at every row of such chunks, sampling.py verifies them, and the
StepLoop reads the result before the next step is planned, rolling the rejected positions out of the
request's computed count (Scheduler.resolve_verified). Verify steps replay the mixed-step graphs
where decode graphs are on (engine.worker.dispatch).
"""
