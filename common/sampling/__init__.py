"""Choosing the next token: the on-device sampler, a running request's state,
logit processors (penalties, biases, grammars) and the structured-output grammars."""
