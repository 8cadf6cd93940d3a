"""What a run leaves (src/shmtrain/runtime/outputs/): model.pt and summary.json, metrics,
plots and traces, a full disk."""
