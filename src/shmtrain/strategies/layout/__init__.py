"""The strategies' parameter layout and its device staging.

- ``flat``: a model's parameters or gradients packed into one flat buffer with per-layer
  views (PACK);
- ``staging``: copies between the parameters' device and host buffers (TRL Algorithm 6);
- ``courier``: the host side of staged hooks (a thread that waits for copies).
"""
