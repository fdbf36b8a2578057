import torch

# Tiny models run fastest single-threaded, and CI shares 2 cores with whatever else runs.
torch.set_num_threads(1)
