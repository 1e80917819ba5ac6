"""Parallel: joining torchrun's process group, and Ray Train as a plugin (FSDP and tensor parallelism are in trainers.py)."""
