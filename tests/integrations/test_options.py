"""ShmtrainStrategy's options are the method's Config, checked when the strategy is made
with the CLI's messages (the option, the value, the rule, the fix)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed (pip install -e '.[test]')")

from shmtrain.lightning import ShmtrainStrategy  # noqa: E402


@pytest.mark.parametrize("method,options,message", [
    ("nope", {}, "--strategy 'nope' is unknown; choose one of: cpu_acc, diloco"),
    ("seasgd", {"update_interva": 2}, "--update-interva does not apply to --strategy seasgd (it takes"),
    ("seasgd", {"update_interval": 0}, "--update-interval 0 must be an integer >= 1"),
    ("ssgd", {"overlap": True, "sharded_update": True}, "--sharded-update with --overlap"),
])
def test_a_bad_option_is_refused_when_the_strategy_is_made(method: str, options: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ShmtrainStrategy(method, **options)


def test_good_options_become_the_methods_typed_config() -> None:
    strategy = ShmtrainStrategy("diloco", sync_every=4, compress="topk:0.25")
    assert strategy.method == "diloco" and type(strategy.config).__qualname__.endswith("Config")
    assert strategy.config.compress == "topk:0.25"


def test_a_precision_that_steps_through_a_grad_scaler_is_refused_with_the_fix() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ShmtrainStrategy("ssgd")
    strategy.precision_plugin = MixedPrecision("16-mixed", device="cpu")
    with pytest.raises(ValueError, match=r"precision='16-mixed' steps through a GradScaler, .* use precision="
                                         r"'32-true' or 'bf16-mixed'"):
        strategy.check_precision()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", device="cpu")
    strategy.check_precision()  # no scaler: accepted
