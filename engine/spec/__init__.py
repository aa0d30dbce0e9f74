"""Speculative decoding's pieces that do not depend on the step loop: proposals from the request's own
tokens (ngram.py) and the verification of proposals against the target model (verify.py). The engine
does not call them yet (issue 40: the verify step, its graphs and the scheduler's accounting)."""
