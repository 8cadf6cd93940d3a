"""The training loop's options (src/shmtrain/runtime/train/): optimizers, schedules, sub-
batches, mixed precision."""
