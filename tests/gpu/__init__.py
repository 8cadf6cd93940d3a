"""The CUDA tests (they skip without a GPU) and ``prove.sh``, the GPU proof in one command."""
