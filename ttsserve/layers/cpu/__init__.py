"""CPU kernels compiled at run time (see kernels.py)."""
