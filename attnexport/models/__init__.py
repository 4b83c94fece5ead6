"""PyTorch modules for every attention variant, one file per family."""
