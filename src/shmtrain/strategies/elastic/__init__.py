"""The shared-buffer methods (ShmCaffe, Ahn et al.): asynchronous and hybrid SGD on global weights.

- ``shared_weights``: what they share (W_g on the buffer service, options, the start);
- ``downpour``, ``easgd``, ``seasgd``, ``hsgd``: ShmCaffe eqs. (1), (2)-(4), (5)-(7) and HSGD;
- ``termination``: aligning the workers' ends (Section III-E); ``eq8``: eq. (8), checked on
  a run's metrics; ``compress``: their ``--compress``.
"""
