"""The worker loop and its data, launching local workers or joining torchrun."""
