"""How bytes move: shared-memory segments, control words, flat buffers, collectives."""
