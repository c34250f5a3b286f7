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


def test_dsink_is_minus_the_sink_probability_times_delta():
    sink = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    lse = torch.randn(3, 2, 5) + 2
    delta = torch.randn(3, 2, 5)
    expected = -(torch.exp(sink.float()[None, :, None] - lse) * delta).sum(dim=(0, 2))
    got = sink_gradient(sink, lse, delta)
    assert got.dtype == sink.dtype and torch.equal(got, expected.to(sink.dtype))
