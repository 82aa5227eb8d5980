"""Logits to tokens: sampler, per-request sampling state, logit shaping, grammars."""
