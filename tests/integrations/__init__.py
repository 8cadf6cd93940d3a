"""shmtrain inside others' trainers: the Lightning strategy (src/shmtrain/lightning/; a
folder named for it would shadow the lightning package on the tests' path) against
DataParallel in a plain loop, its checkpoints and phase times, and the recipes of
docs/integrations.md."""
