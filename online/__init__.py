"""Online DPO (Guo et al. 2024): a trainer that samples, labels and trains on its own pairs; make_pairs.py."""
