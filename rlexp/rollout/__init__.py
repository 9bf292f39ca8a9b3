"""Inference engines and the multi-turn rollout driver."""
