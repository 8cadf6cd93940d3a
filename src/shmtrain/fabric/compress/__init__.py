"""Compressed exchanges.

- ``codec``: chunked top-k with low-bit values and error feedback (with its compiled
  encoder in ``fabric/native/``);
- ``allreduce``: the compressed mean across hosts (dense inside a host, compressed on the
  link). The memory server's compressed reads and accumulates are ``fabric/smb/compressed.py``.
"""
