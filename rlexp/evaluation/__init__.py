"""Evaluation on the pinned mazes: the model, or scripted baselines."""
