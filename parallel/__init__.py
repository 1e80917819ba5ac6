"""Parallel plugins: Ray Train (FSDP and tensor parallelism are in trainers.py)."""
