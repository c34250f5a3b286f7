"""Attention sinks on the CPU: argument checks before any launch, dsink's formula."""
from __future__ import annotations

import pytest
import torch

import flashkiln
from flashkiln.sinks import prepare_sink, sink_gradient


def q_like(hq=4):
    return torch.randn(2, hq, 16, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("sink,match", [
    (torch.zeros(3), r"shape \(H_q,\) = \(4,\)"),
    (torch.zeros(1, 4), r"shape \(H_q,\)"),
    (torch.zeros(4, dtype=torch.int32), "float32, float16 or bfloat16"),
    ([0.0] * 4, "torch.Tensor or None"),
])
def test_bad_sinks_are_typed_errors(sink, match):
    q = q_like()
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_forward(q, q, q, sink=sink)


def test_the_kernel_reads_dense_fp32_sinks():
    sink = torch.arange(8, dtype=torch.bfloat16)[::2]
    got = prepare_sink(sink, q_like())
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, sink.float())


def test_dsink_sums_the_kernel_parts_and_the_lse_gradient_term():
    sink = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    parts = torch.randn(3, 2, 4)  # the kernel's per-key-tile sums of p_sink * P * dP
    lse = torch.randn(3, 2, 5) + 2
    dlse = torch.randn(3, 2, 5)
    # d LSE / d sink = p_sink, and dSink = -sum p_sink * (rowsum(P dP) - dLSE).
    expected = -parts.sum(dim=(0, 2)) + (torch.exp(sink.float()[None, :, None] - lse) * dlse).sum(dim=(0, 2))
    got = sink_gradient(sink, parts, lse, dlse)
    assert got.dtype == sink.dtype and torch.equal(got, expected.to(sink.dtype))
    assert torch.equal(sink_gradient(sink, parts, lse, None), (-parts.sum(dim=(0, 2))).to(sink.dtype))