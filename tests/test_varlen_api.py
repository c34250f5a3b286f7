"""Packed variable-length batches on the CPU: argument checks, the views the kernels see, the launch
plans (grids, params, workspaces) and the custom ops' fake shapes."""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashkiln
from flashkiln.params import DQ_ACCUM_ROW_ALIGN
from flashkiln.ops import attention_backward_op, attention_forward_op
from flashkiln.sinks import sink_gradient
from flashkiln.varlen import BatchShape, PackedBatch, as_batched, as_tokens, token_mask
from test_attention_api import registry  # noqa: F401  (fixture: fake forward registry)
from test_backward_api import H200_MEMORY, ROUTE_ENV, make_registry, bwd_descriptor, CAUSAL
from test_registry import planned_backward, planned_forward

def packed_inputs(lengths_q=(5, 0, 130), lengths_k=(7, 3, 0), hq=4, hkv=2, d=64, extra_tokens=2):
    """Token tensors with `extra_tokens` past the last sequence, and their PackedBatch."""
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]) + extra_tokens, int(cu_k[-1]) + extra_tokens
    q = torch.zeros(total_q, hq, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(total_k, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, PackedBatch(cu_q, cu_k, max(lengths_q), max(lengths_k))


# -- checks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (lambda q, k, v, p: (q[None], k, v, p), r"q must be a 3-D \(total_tokens, heads, head_dim\) tensor"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(p.cu_seqlens_q.long(), p.cu_seqlens_k, 130, 7)),
     "cu_seqlens_q must be a 1-D torch.int32"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(p.cu_seqlens_q, p.cu_seqlens_k[:-1], 130, 7)),
     "the same length"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(p.cu_seqlens_q, p.cu_seqlens_k[None], 130, 7)),
     "cu_seqlens_k must be a 1-D"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(p.cu_seqlens_q, p.cu_seqlens_k, -1, 7)),
     "max_seqlen_q must be a non-negative int"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(p.cu_seqlens_q, p.cu_seqlens_k, 130, 7.0)),
     "max_seqlen_k must be a non-negative int"),
    (lambda q, k, v, p: (q, k, v, PackedBatch(torch.zeros(8, dtype=torch.int32)[::2], p.cu_seqlens_k, 130, 7)),
     "cu_seqlens_q must be contiguous"),
])
def test_bad_packed_arguments_are_refused_before_any_launch(registry, change, match):  # noqa: F811
    q, k, v, packed = change(*packed_inputs())
    with pytest.raises(flashkiln.InvalidInputError, match=match):
        flashkiln.attention_forward(q, k, v, packed=packed, registry=registry)
    assert registry.fake_driver.calls == []


def test_outputs_and_backward_tensors_must_be_in_token_layout(registry):  # noqa: F811
    q, k, v, packed = packed_inputs()
    with pytest.raises(flashkiln.InvalidInputError, match=r"lse must be a 2-D \(H_q, total_q\)"):
        flashkiln.attention_forward(q, k, v, packed=packed, lse=torch.zeros(1, 4, q.shape[0]), registry=registry)
    with pytest.raises(flashkiln.InvalidInputError, match=r"out must be a 3-D \(total_tokens"):
        flashkiln.attention_forward(q, k, v, packed=packed, out=torch.zeros(1, *q.shape, dtype=q.dtype),
                                    registry=registry)
    with pytest.raises(flashkiln.InvalidInputError, match=r"dout must be a 3-D"):
        flashkiln.attention_backward(q[None], q, k, v, q, torch.zeros(4, q.shape[0]), packed=packed,
                                     registry=registry)
    assert registry.fake_driver.calls == []


def test_the_ops_need_both_boundaries():
    q, k, v, packed = packed_inputs()
    with pytest.raises(flashkiln.InvalidInputError, match="both cu_seqlens_q and cu_seqlens_k"):
        attention_forward_op(q, k, v, None, None, "none", 0.125, None, packed.cu_seqlens_q, None, 130, 7)


def test_views_round_trip_and_the_kernels_see_one_batch_entry():
    q, k, _, packed = packed_inputs()
    view = as_batched(q)
    assert view.shape == (1, 4, q.shape[0], 64) and view.data_ptr() == q.data_ptr()
    assert as_tokens(view).shape == q.shape and as_tokens(view).stride() == q.stride()
    lse = torch.zeros(4, q.shape[0])
    assert as_batched(lse).shape == (1, 4, q.shape[0]) and as_tokens(as_batched(lse)).shape == lse.shape
    shape = BatchShape.of(view, as_batched(k), packed)
    assert (shape.batch, shape.seqlen_q, shape.seqlen_k, shape.total_q, shape.total_k) == (3, 130, 7, 137, 12)
    assert shape.scores(4) == (3, 4, 130, 7)


def test_token_mask_covers_the_sequences_only():
    _, _, _, packed = packed_inputs(lengths_q=(2, 0, 3))
    assert token_mask(packed.cu_seqlens_q, 7).tolist() == [True] * 5 + [False] * 2


def test_sink_gradient_ignores_rows_outside_the_sequences():
    sink = torch.tensor([0.5, -1.0])
    parts = torch.tensor([[[0.25, 1.0], [2.0, -4.0]]])  # (batch, H, key tiles)
    lse = torch.tensor([[[1.0, 2.0, float("nan")], [0.0, 1.0, float("inf")]]])
    dlse = torch.tensor([[[0.25, -0.5, float("nan")], [1.0, 2.0, 3.0]]])
    got = sink_gradient(sink, parts, lse, dlse, torch.tensor([True, True, False]))
    expected = -parts[0].sum(1) + (torch.exp(sink[:, None] - lse[0, :, :2]) * dlse[0, :, :2]).sum(1)
    assert torch.allclose(got, expected)


# -- plans -------------------------------------------------------------------------------------------

def test_forward_plan_covers_the_longest_sequence_per_batch_entry(registry):  # noqa: F811
    q, k, v, packed = packed_inputs()
    qb, kb, vb = (as_batched(t) for t in (q, k, v))
    out = torch.zeros(1, 4, q.shape[0], 64, dtype=q.dtype)
    lse = torch.zeros(1, 4, q.shape[0])
    launch = planned_forward(qb, kb, vb, out, lse, "none", 0.125, None, (9, 0), registry, packed=packed)
    p = launch.params
    assert launch.grid == (math.ceil(130 / launch.entry.descriptor["tile_m"]), 4, 3)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k) == (3, 130, 7, 137, 12)
    assert (p.cu_seqlens_q, p.cu_seqlens_k) == (packed.cu_seqlens_q.data_ptr(), packed.cu_seqlens_k.data_ptr())
    assert (p.q_head_stride, p.q_row_stride) == (64, 4 * 64)


def test_dense_plans_have_no_boundaries_and_totals_equal_to_the_seqlens(registry):  # noqa: F811
    q = torch.zeros(2, 4, 33, 64, dtype=torch.float16)
    k = v = torch.zeros(2, 2, 40, 64, dtype=torch.float16)
    p = planned_forward(q, k, v, torch.zeros_like(q), torch.zeros(2, 4, 33), "none", 0.125, None, (9, 0),
                     registry).params
    assert (p.cu_seqlens_q, p.cu_seqlens_k, p.total_q, p.total_k) == (0, 0, 33, 40)


@pytest.fixture
def bwd_registry(tmp_path):
    return make_registry(tmp_path, [bwd_descriptor("bwd_dq", c, d=d) for c in CAUSAL for d in (64, 128, 256)])


def backward_plan(bwd_registry, route, hkv=2, **kwargs):
    q, k, v, packed = packed_inputs(hkv=hkv, d=128)
    qb, kb, vb = (as_batched(t) for t in (q, k, v))
    out = dout = torch.zeros_like(qb)
    grads = (torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb))
    lse = torch.zeros(1, 4, q.shape[0])
    return planned_backward(dout, qb, kb, vb, out, lse, *grads, "none", 0.125, route == "ordered", (9, 0),
                         H200_MEMORY, bwd_registry, packed=packed, **kwargs)


def test_atomic_plan_gives_each_sequence_aligned_accumulator_rows(bwd_registry, monkeypatch):
    monkeypatch.setenv(ROUTE_ENV, "atomic")
    plan = backward_plan(bwd_registry, "atomic")
    pre, main, post = plan.launches
    p = main.params
    assert p.seqlen_q_rounded == 256 and p.dq_accum_rows == 137 + 3 * DQ_ACCUM_ROW_ALIGN
    s = plan.scratch
    delta, dq_accum, semaphore, workspace = (s[r] for r in ("delta", "dq_accum", "dq_semaphore", "ds_workspace"))
    assert delta.shape == (1, 4, 137) and dq_accum.shape == (1, 4, 137 + 3 * 128, 128)
    assert semaphore is None and workspace is None
    assert main.grid == (1, 4, 3) and pre.grid == (256 // 16, 4, 3) and post.grid == (math.ceil(130 / 16), 4, 3)
    # GQA: per-query-head dK/dV over every key token, zero where no sequence writes.
    assert plan.scratch["dk_accum"].shape == (1, 4, 12, 128) and not plan.scratch["dk_accum"].any()


def test_workspace_plan_sizes_ds_by_the_longest_sequences(bwd_registry, monkeypatch):
    monkeypatch.setenv(ROUTE_ENV, "workspace")
    plan = backward_plan(bwd_registry, "workspace", hkv=4)
    assert plan.route == "workspace" and plan.scratch["dk_accum"] is None
    workspace = plan.scratch["ds_workspace"]
    assert workspace.numel() == 3 * 4 * 130 * 8  # max_seqlen_k = 7 padded to 8
    assert plan.launches[2].grid == (math.ceil(130 / 64), 4, 3)


# -- custom ops' fakes -------------------------------------------------------------------------------

def test_fake_ops_give_token_layouts():
    q, k, v, packed = packed_inputs(d=64)
    bias = torch.zeros(3, 4, 130, 7, dtype=q.dtype)
    sink = torch.zeros(4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, fb, fs, cu_q, cu_k = (mode.from_tensor(t) for t in
                                          (q, k, v, bias, sink, packed.cu_seqlens_q, packed.cu_seqlens_k))
        out, lse = attention_forward_op(fq, fk, fv, fb, fs, "none", 0.125, None, cu_q, cu_k, 130, 7)
        assert out.shape == (137, 4, 64) and out.stride() == (256, 64, 1) and lse.shape == (4, 137)
        dq, dk, dv, dbias, dsink = attention_backward_op(out, fq, fk, fv, out, lse, None, fb, True, fs, True, "none",
                                                         0.125, None, cu_q, cu_k, 130, 7)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dq.stride() == q.stride() and dbias.shape == bias.shape and dsink.shape == (4,)


def test_backward_tiles_must_divide_the_accumulator_alignment():
    from flashkiln.generator.families import FAMILIES
    errors = FAMILIES["portable"].tuning_errors(bwd_descriptor("bwd", tiles=(96, 64, 4, 1)))
    assert any(f"must divide {DQ_ACCUM_ROW_ALIGN}" in e for e in errors)
    assert not any("must divide" in e for e in FAMILIES["portable"].tuning_errors(bwd_descriptor("bwd")))


@pytest.mark.parametrize("cu_q, cu_k, match", [
    ([0, 5, 5, 135], [0, 7, 10, 10], None),
    ([0, 5, 3, 135], [0, 7, 10, 10], r"cu_seqlens_q: sequence 1 has -2 tokens"),
    ([-1, 5, 5, 135], [0, 7, 10, 10], "cu_seqlens_q runs from -1 to 135, outside the 137 tokens"),
    ([0, 5, 5, 135], [0, 7, 10, 13], "cu_seqlens_k runs from 0 to 13, outside the 12 tokens"),
    ([0, 5, 5, 135], [0, 8, 10, 10], r"cu_seqlens_k: sequence 0 has 8 tokens \(0 to 8\), not in \[0, max_seqlen = 7\]"),
])
def test_validate_names_the_first_bad_offset(cu_q, cu_k, match):
    packed = PackedBatch(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 130, 7)
    if match is None:
        packed.validate(137, 12)
    else:
        with pytest.raises(flashkiln.InvalidInputError, match=match):
            packed.validate(137, 12)


def test_sequence_rows_gathers_each_sequence_rows_from_the_tokens():
    from flashkiln.varlen import sequence_rows

    cu = torch.tensor([1, 3, 3, 6], dtype=torch.int32)  # token 0 and 6 lie in no sequence
    packed = PackedBatch(cu, cu, 3, 3)
    tokens = torch.arange(2 * 7, dtype=torch.float32).view(1, 2, 7)  # (1, H, total)
    (rows, none), valid = sequence_rows((tokens, None), packed)
    assert none is None and rows.shape == (3, 2, 3) and valid.shape == (3, 1, 3)
    assert valid[:, 0].tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    assert rows[0, 1, :2].tolist() == [8.0, 9.0] and rows[2, 0].tolist() == [3.0, 4.0, 5.0]
