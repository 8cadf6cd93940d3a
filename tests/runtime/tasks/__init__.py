"""Tasks other than classification (src/shmtrain/runtime/tasks/), the language-model
example among them."""
