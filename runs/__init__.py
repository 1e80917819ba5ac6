"""Runs: run folders, checkpoints and resume, config checks, processes and faults, metrics, sweeps."""
