"""The defaults a run's setting picks: one host or across hosts, for the options a user left out.

Most options have one default. A few train well in one setting and starve or swing in
another (docs/choosing_a_method.md, "Defaults by setting", has the measurements), so
when the user did not give them (on the command line or in a ``--config`` file) the run's
setting chooses them, once, before the run folder's ``config.toml`` is written:

- **seasgd and hsgd across hosts** (compressed or not): the exchange with the memory
  server across the link compressed (``--compress topk:0.1,bits:4``: whole weights each
  exchange left host b's workers 15-17 of their 400 iterations), the hosts paced
  (``--host-lead 0.05``: unpaced, host a exchanged 3 times as often and pulled W_g to its
  classes), the elastic rate ``--moving-rate 0.5``, and a larger step decayed to 0
  (``--lr 0.2 --lr-schedule cosine``): the roots and W_g share each exchange's
  difference, so the consensus of two roots moves at 2/3 of a root's step, and a constant
  step keeps W_g swinging between the hosts' classes to the end (Zhang et al. 2015,
  "Deep learning with Elastic Averaging SGD", Section 3: beta = p alpha). On one host,
  ShmCaffe's moving rate (Ahn et al., "ShmCaffe", the experiments' ``moving_rate`` 0.2
  with ``update_interval`` 1) and the run's ``--lr 0.05``, constant.
- **DiLoCo with ``--inner host-sync`` across hosts** (the hybrid), uncompressed:
  ``--sync-every 10`` (H 20 left each host's model 20 steps on its own classes before the
  outer step: 0.847 on the class split, against 0.978 at H 10; Douillard et al. 2023,
  "DiLoCo", Section 3, H the inner steps).
- **DiLoCo compressed across hosts** (``--compress``, either inner): the hosts' models
  averaged every 4 steps, ``--sync-every 4 --outer-lr 1 --outer-momentum 0`` (the outer
  Nesterov momentum carried the compression's error into swings: at H 20 the hybrid ended
  at 0.916 and diloco at 0.947, at H 10 with DiLoCo's (0.7, 0.8) the hybrid at 0.936).
  Plain DiLoCo uncompressed, and one host, keep H 20 and the outer step derived from the
  inner optimizer.

:func:`settle` applies the rule to a resolved config and keeps the record
(``TrainConfig.defaults_taken``: option, value, why), which ``config.toml`` and the first
metrics row carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmtrain.runtime.config import resolve

#: the compressed exchange across hosts of seasgd and hsgd (docs/async.md)
ELASTIC_COMPRESS = "topk:0.1,bits:4"

_ELASTIC = ("seasgd", "hsgd")


@dataclass(frozen=True)
class Taken:
    """One default the setting chose: the option (its flag name), the value, and why."""

    option: str
    value: Any
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"option": self.option, "value": self.value, "why": self.why}


def rule(strategy: str, options: dict[str, Any], nodes: int) -> list[Taken]:
    """The defaults of ``strategy`` (with its ``options``, flat) in a job of ``nodes``
    hosts, for every option the rule governs (the caller keeps those the user gave)."""
    where = f"{nodes} hosts" if nodes > 1 else "one host"
    if strategy in _ELASTIC:
        if nodes == 1:
            why = (f"{strategy} on one host: ShmCaffe's moving rate 0.2 and a constant step "
                   "(docs/choosing_a_method.md, Defaults by setting)")
            return [Taken("moving-rate", 0.2, why), Taken("lr", 0.05, why), Taken("lr-schedule", "constant", why)]
        return [
            Taken("compress", ELASTIC_COMPRESS, f"{strategy} across {where}: whole weights per exchange starved the "
                  "host across the link (15-17 of 400 iterations at 100 Mbit/s)"),
            Taken("host-lead", 0.05, f"{strategy} across {where}: unpaced, the server's host exchanged 3x as often "
                  "and pulled the global weights to its classes"),
            Taken("moving-rate", 0.5, f"{strategy} across {where}: measured with lr 0.2 cosine (alpha 0.2: 0.933)"),
            Taken("lr", 0.2, f"{strategy} across {where}: the roots and W_g share each exchange, so W_g moves at "
                  "2/3-4/5 of a worker's step (lr 0.05 ended 3-4 points under DDP)"),
            Taken("lr-schedule", "cosine", f"{strategy} across {where}: a constant step keeps W_g swinging "
                  "between the hosts' classes to the end"),
        ]
    if strategy == "diloco" and nodes > 1 and options.get("compress"):
        why = (f"compressed DiLoCo across {where}: the hosts' compressed pseudo-gradients averaged every 4 steps "
               "(outer lr 1, no momentum); at H 20 with the derived outer step the hybrid ended at 0.916 and "
               "diloco at 0.947, at H 4 averaged both at 0.969")
        return [Taken("sync-every", 4, why), Taken("outer-lr", 1.0, why), Taken("outer-momentum", 0.0, why)]
    if strategy == "diloco" and options.get("inner") == "host-sync":
        if nodes == 1:
            return [Taken("sync-every", 20, "the hybrid on one host: DiLoCo's H 20")]
        return [Taken("sync-every", 10, f"the hybrid across {where}: H 20 left each host 20 steps on its own data "
                      "(0.847 on a class split), H 10 0.978")]
    return []


def settle(config: Any, nodes: int) -> Any:
    """``config`` (a resolved ``TrainConfig``) with the defaults :func:`rule` picks for a job
    of ``nodes`` hosts set for the options the user did not give (``config.given``), and
    the record of them in ``defaults_taken``; the same config when there is none to take
    (or it was settled already)."""
    if config.defaults_taken or not config.given:
        return config
    flat = config.to_dict()
    taken = [t for t in rule(config.strategy, flat, nodes) if t.option.replace("-", "_") not in config.given]
    if not taken:
        return config
    changed = {t.option.replace("-", "_"): t.value for t in taken}
    settled = resolve({k: v for k, v in {**flat, **changed}.items() if v is not None})
    settled.given = config.given
    settled.defaults_taken = tuple(t.as_dict() for t in taken)
    return settled
