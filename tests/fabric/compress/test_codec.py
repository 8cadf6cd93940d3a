"""The compressed exchange's codec (``--compress topk:F,bits:B``, fabric/compress/codec.py):
the option's parser, the exact top-k of its two-stage selection, the payload's layout,
error feedback, and why it is there (a quadratic that plain top-k never solves)."""

from __future__ import annotations

import json

import pytest
import torch

from shmtrain.fabric.compress.codec import (
    CHUNK,
    GROUP,
    Codec,
    Compressor,
    CompressSpec,
    parse_compress,
)


@pytest.mark.parametrize(("text", "spec"), [
    ("topk:0.01,bits:4", CompressSpec(0.01, 4)),
    (" topk:0.5 , bits:2 ", CompressSpec(0.5, 2)),
    ("bits:8", CompressSpec(1.0, 8)),
    ("topk:0.1", CompressSpec(0.1, 32)),
    ("topk:0.1,bits:32,feedback:off", CompressSpec(0.1, 32, False)),
])
def test_the_option_parses_and_spells_itself_back(text: str, spec: CompressSpec) -> None:
    assert parse_compress(text) == spec
    assert parse_compress(spec.text()) == spec


@pytest.mark.parametrize("text", ["", "none", None])
def test_no_compression(text) -> None:
    assert parse_compress(text) is None


@pytest.mark.parametrize(("text", "rule"), [
    ("topk:0", r"topk:0 must lie in \(0, 1\]: the kept share of every chunk"),
    ("topk:1.5,bits:4", r"topk:1.5 must lie in \(0, 1\]"),
    ("topk:x", r"topk:x must be a number in \(0, 1\]"),
    ("topk:0.1,bits:3", r"bits:3 must be one of 2, 4, 8, 32 \(the value width\)"),
    ("topk:0.1,bits:four", r"bits:four must be one of 2, 4, 8, 32"),
    ("top:0.1", r"'top:0.1' is not one of topk:F, bits:B, feedback:on\|off"),
    ("topk:0.1,topk:0.2", r"topk is given twice"),
    ("topk:0.1,feedback:no", r"feedback:no must be on or off"),
])
def test_bad_values_are_refused_naming_the_option_the_rule_and_the_fix(text: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rf"--compress {text!r}: {rule}.*; pass e\.g\. --compress topk:0\.01,bits:4"):
        parse_compress(text)


@pytest.mark.parametrize("numel", [7, 1000, CHUNK, 3 * CHUNK + 5])
@pytest.mark.parametrize("fraction", [0.003, 0.01, 0.2, 1.0])
def test_the_selection_is_the_top_k_of_every_chunk(numel: int, fraction: float) -> None:
    codec = Codec(numel, CompressSpec(fraction, 32))
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    rows = codec._rows(vector)
    picked = torch.gather(rows.abs(), 1, codec.select(rows)).sort(dim=1).values
    expected = torch.topk(rows.abs(), codec.k, dim=1).values.sort(dim=1).values
    assert torch.equal(picked, expected)
    staged = codec.chunk % GROUP == 0 and codec.k * GROUP * 4 <= codec.chunk
    assert codec._staged == staged  # both selections are checked: 1000 and CHUNK at 1% staged, 7 and 20% not


@pytest.mark.parametrize("bits", [2, 4, 8, 32])
def test_error_feedback_keeps_exactly_what_was_not_sent(bits: int) -> None:
    """Δ + e_before = D(C(Δ + e_before)) + e_after, over several exchanges; the payload
    has the layout's size, and D puts k values in every chunk."""
    numel, spec = 2 * CHUNK + 100, CompressSpec(0.05, bits)
    comp = Compressor(numel, spec)
    codec = comp.codec
    kept = codec.chunks * codec.k
    floats = kept if bits == 32 else codec.chunks
    assert codec.nbytes == 4 * floats + 2 * kept + (0 if bits == 32 else -(-kept * bits // 8))
    gen = torch.Generator().manual_seed(0)
    out = torch.empty(numel)
    for _ in range(3):
        delta = torch.randn(numel, generator=gen)
        before = comp.error[:numel].clone()
        payload = comp.encode(delta)
        assert payload.numel() == codec.nbytes
        comp.mean([payload], out)
        assert int((out != 0).sum()) <= kept
        torch.testing.assert_close(out + comp.error[:numel], delta + before, rtol=0, atol=1e-5)
        assert comp.error[numel:].abs().max() == 0  # the padding never carries an error
    if bits == 32:  # float32 values: the kept places leave no error at all
        assert int((comp.error[:numel] == 0).sum()) >= codec.k


def _exchanges(numel: int, spec: CompressSpec, seed: int, times: int = 3,
               native: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(D(C(Δ + e)), e afterwards) over ``times`` exchanges of normal Δ."""
    comp, gen, out = Compressor(numel, spec, native), torch.Generator().manual_seed(seed), torch.empty(numel)
    rows = []
    for _ in range(times):
        payload = comp.encode(torch.randn(numel, generator=gen))
        rows.append((comp.mean([payload], out).clone(), comp.error.clone()))
    return rows


@pytest.mark.parametrize("numel", [7, 1000, 2 * CHUNK + 100])
@pytest.mark.parametrize("fraction", [0.003, 0.05, 0.2, 1.0])
@pytest.mark.parametrize("bits", [2, 8, 32])
@pytest.mark.parametrize("feedback", [True, False])
def test_the_c_encoder_sends_and_keeps_the_torch_paths_bits(numel, fraction, bits, feedback) -> None:
    """compress_native.c against the torch path: the same D(C(Δ + e)) and the same e, bit
    for bit, over three exchanges, through each of its selections (a few groups scanned at
    0.3%, the k-th's bin counted at 5% and 20%, all of a chunk at 1.0; 7 and 1000 elements
    make a chunk of their own size)."""
    from shmtrain.fabric import native

    if native.library() is None:
        pytest.skip(f"the C library cannot be built here: {native.why_not}")
    spec = CompressSpec(fraction, bits, feedback)
    compiled, torch_path = _exchanges(numel, spec, seed=numel), _exchanges(numel, spec, seed=numel, native=False)
    for (sent, error), (sent_t, error_t) in zip(compiled, torch_path, strict=True):
        assert torch.equal(sent, sent_t)
        assert torch.equal(error, error_t)


@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_ties_go_to_the_lower_index_and_a_zero_vector_sends_zeros(fraction: float) -> None:
    """Equal magnitudes (whole chunks of ±1, or of 0) leave the choice to the tie rule:
    the C encoder keeps the lowest places, the same every call; the torch path any k of
    them. Either way k places of the largest magnitude are sent and the rest is kept."""
    numel = 2 * CHUNK
    comp = Compressor(numel, CompressSpec(fraction, 4))
    codec = comp.codec
    ones = torch.ones(numel)
    ones[1::2] = -1
    ones[CHUNK + 3] = 2.0  # one larger magnitude in the second chunk
    sent = comp.mean([comp.encode(ones).clone()], torch.empty(numel)).view(2, CHUNK)
    assert int((sent != 0).sum()) == 2 * codec.k
    assert sent[1, 3] == 2.0 and sent.abs().max() == 2.0
    fresh = [Compressor(numel, CompressSpec(fraction, 4)) for _ in range(2)]
    first, again = (one.mean([one.encode(ones)], torch.empty(numel)) for one in fresh)
    assert torch.equal(first, again)
    from shmtrain.fabric import native

    if native.library() is not None:  # the lowest places: 0 .. k-1 in both chunks (place 3 is among them)
        assert torch.equal(sent[0].nonzero().view(-1), torch.arange(codec.k))
        assert torch.equal(sent[1].nonzero().view(-1), torch.arange(codec.k))
    zero = Compressor(numel, CompressSpec(fraction, 4))
    out = zero.mean([zero.encode(torch.zeros(numel))], torch.empty(numel))
    assert out.abs().max() == 0 and zero.error.abs().max() == 0


def test_the_mean_of_payloads_is_the_mean_of_what_each_sent() -> None:
    numel, spec = 3000, CompressSpec(0.1, 8)
    senders = [Compressor(numel, spec) for _ in range(3)]
    gen = torch.Generator().manual_seed(2)
    payloads, dense = [], []
    for comp in senders:
        payloads.append(comp.encode(torch.randn(numel, generator=gen)).clone())
        one = torch.empty(numel)
        dense.append(comp.mean([payloads[-1]], one))
    out = torch.empty(numel)
    senders[0].mean(payloads, out)
    torch.testing.assert_close(out, torch.stack(dense).mean(0), rtol=1e-6, atol=1e-7)


def _quadratic(spec: CompressSpec, steps: int = 400) -> torch.Tensor:
    """Two hosts minimise f(x) = ½‖x − a‖² + ½‖x − b‖², a = (10, 1), b = (−10, 1), each
    sending the top-1 of its gradient (one chunk of two elements), step 0.5 / (1 + t/10):
    x* = (0, 1)."""
    targets = [torch.tensor([10.0, 1.0]), torch.tensor([-10.0, 1.0])]
    hosts = [Compressor(2, spec) for _ in targets]
    x, mean = torch.zeros(2), torch.empty(2)
    for t in range(steps):
        payloads = [host.encode(x - target).clone() for host, target in zip(hosts, targets, strict=True)]
        hosts[0].mean(payloads, mean)
        x -= 0.5 / (1 + t / 10) * mean
    return x


@pytest.mark.parametrize("bits", [32, 4, 2])
def test_top_k_with_error_feedback_converges_on_a_quadratic_where_plain_top_k_does_not(bits: int) -> None:
    """Plain top-k: at x = (0, 0) each host's top-1 is its ±10 on x1, the two cancel, and
    x2 never moves (the fixed point is (0, 0), f − f* = 1 for good). With error feedback
    the x2 parts add up until they are sent (Karimireddy et al. 2019)."""
    optimum = torch.tensor([0.0, 1.0])
    plain = _quadratic(CompressSpec(0.5, bits, feedback=False))
    fed = _quadratic(CompressSpec(0.5, bits, feedback=True))
    assert float((plain - optimum).norm()) > 0.99
    assert float((fed - optimum).norm()) < 0.05


def test_the_benchmark_prints_gb_s_and_writes_json(tmp_path, capsys) -> None:
    from shmtrain.cli import main

    path = tmp_path / "compress.json"
    assert main(["bench", "compress", "--numel", str(1 << 16), "--compress", "topk:0.01,bits:4", "bits:8",
                 "--repeats", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["compress"] for r in rows] == ["topk:0.01,bits:4", "topk:1,bits:8"]
    for row in rows:
        assert row["compress_gb_s"] > 0 and row["decompress_gb_s"] > 0 and row["threads"] == 1
        assert row["ratio"] == 4 * (1 << 16) / row["payload_bytes"]
    assert rows[0]["ratio"] > 100
    from shmtrain.fabric import native

    assert rows[0]["encoder"] == ("C" if native.library() is not None else f"torch ({native.why_not})")
    assert all(row["same_as_torch"] is True and row["torch_compress_gb_s"] > 0 for row in rows)
    assert rows[0]["speedup"] == pytest.approx(rows[0]["compress_gb_s"] / rows[0]["torch_compress_gb_s"])
    out = capsys.readouterr().out
    assert "comp cpu GB/s" in out and "topk:0.01,bits:4" in out
