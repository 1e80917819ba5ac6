"""Evaluation: sampling from a policy, reward models, reward functions and judges, win rates (evaluate.py)."""
