"""The attention forward: checks, kernel choice, launch."""
from __future__ import annotations

import math

import torch

from . import inputs
from .backends import check_backend
from .bias import KernelBias, prepare_bias
from .head_dims import kernel_dims, padded
from .hopper_forward import plan_if_hopper
from .launch import KernelLaunch, Target, ceil_div, request, run
from .params import FwdParams
from .registry import KernelRegistry, default_registry
from .sinks import prepare_sink
from .varlen import TOKENS, BatchShape, PackedBatch, as_batched, as_tokens, batched_view, check_packed, token_mask


def plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 causal: str, scale: float, bias: KernelBias | None, capability: tuple[int, int],
                 registry: KernelRegistry, sink: torch.Tensor | None = None,
                 packed: PackedBatch | None = None) -> KernelLaunch:
    """Choose the kernel and pack its parameters; q, k, v, out, lse and bias are already checked
    (for a packed batch: their (1, H, total, d) views)."""
    _, hq, _, dqk = q.shape
    _, hkv, _, dv = v.shape
    shape = BatchShape.of(q, k, packed)
    entry = registry.find(request("fwd", inputs.DTYPES[q.dtype], dqk, dv, causal, bias=bias is not None),
                          capability)
    params = FwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), lse=lse.data_ptr(),
        bias=0 if bias is None else bias.tensor.data_ptr(), sink=0 if sink is None else sink.data_ptr(),
        **inputs.stride_fields("q", q), **inputs.stride_fields("k", k), **inputs.stride_fields("v", v),
        **inputs.stride_fields("o", out), **(bias.stride_fields() if bias is not None else {}),
        heads_q=hq, heads_kv=hkv, **shape.params(), scale=scale, scale_log2=scale * math.log2(math.e),
    )
    return KernelLaunch(entry, (ceil_div(shape.seqlen_q, entry.descriptor["tile_m"]), hq, shape.batch), params)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: str | None = None,
                      scale: float | None = None, bias: torch.Tensor | None = None,
                      sink: torch.Tensor | None = None, packed: PackedBatch | None = None,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      registry: KernelRegistry | None = None,
                      backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward: softmax(scale * q kᵀ + bias, causal mask) v and its log-sum-exp.

    q: (B, H_q, S_q, d_qk), k: (B, H_kv, S_k, d_qk), v: (B, H_kv, S_k, d_v), fp16 or bf16 on one
    CUDA device, any strides with a contiguous head dim (others are copied first); H_q a multiple
    of H_kv (GQA/MQA). causal: None, "top_left" (key j visible to query i iff j <= i) or
    "bottom_right" (iff j <= i + S_k - S_q). scale defaults to 1/sqrt(d_qk). bias: an additive
    score bias broadcastable to (B, H_q, S_q, S_k) in the inputs' dtype, or a bool mask (True
    keeps), as F.scaled_dot_product_attention's attn_mask (flashkiln.bias). sink: (H_q,) sink logits
    that join each row's softmax denominator; the LSE includes them (flashkiln.sinks).
    Returns out (B, H_q, S_q, d_v), in q's memory order, and lse (B, H_q, S_q) in fp32 (natural
    log; -inf for a query that sees no key, whose output row is 0). `out` and `lse` may be given
    preallocated. backend: "hopper" (the sm_90a TMA/wgmma family; raises UnsupportedError or
    VariantNotFoundError for what it cannot run), "portable", or None: hopper where it can run the
    call, portable otherwise (flashkiln.backends). No autograd here: see
    flashkiln.scaled_dot_product_attention.

    packed: a packed variable-length batch (flashkiln.varlen): q (total_q, H_q, d_qk), k and v
    (total_k, H_kv, d), out (total_q, H_q, d_v) and lse (H_q, total_q); causal masks and a bias
    (broadcastable to (B, H_q, max_seqlen_q, max_seqlen_k), sequence b reading the top-left
    corner of entry b) apply per sequence.
    """
    check_backend(backend)
    if packed is not None:
        check_packed(q, k, v, packed)
        out = None if out is None else batched_view("out", out, TOKENS)
        lse = None if lse is None else batched_view("lse", lse, "(H_q, total_q)")
        q, k, v = (as_batched(t) for t in (q, k, v))
    inputs.check_qkv(q, k, v)
    shape = BatchShape.of(q, k, packed)
    causal_mode, scale = inputs.check_causal_scale(causal, scale, q.shape[3])
    kernel_bias = None if bias is None else prepare_bias(bias, shape.scores(q.shape[1]), q)
    kernel_sink = None if sink is None else prepare_sink(sink, q)
    if q.device.type != "cuda":
        inputs.fail(f"inputs must be CUDA tensors, got device {q.device}")
    registry = registry or default_registry()
    target = Target.of(q)
    d_qk, d_v = q.shape[3], v.shape[3]
    dims = kernel_dims(d_qk, d_v, registry.head_dims("fwd", inputs.DTYPES[q.dtype], target.capability), "forward")
    given = {"out": out, "lse": lse}
    out = inputs.empty_in_memory_order(q, d_v) if out is None else out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if lse is None else lse
    inputs.check_forward_outputs(q, out, lse, d_v, written_in_place=dims == (d_qk, d_v))
    readers = {"q": q, "k": k, "v": v, "bias": bias, "sink": sink}
    for name, buffer in given.items():
        if buffer is not None:
            inputs.check_output_buffer(name, buffer, {**readers, **{n: b for n, b in given.items() if n != name}})
    if packed is not None:
        # Tokens in no sequence: O = 0 and LSE = -inf, as a row that sees no key (the kernels
        # write the tokens inside sequences only). A fresh buffer is filled whole (a memset), a
        # given one where no sequence is.
        outside = None
        for buffer, caller_buffer, fill in ((out, given["out"], 0.0), (lse, given["lse"], float("-inf"))):
            if caller_buffer is None:
                buffer.fill_(fill)
                continue
            if outside is None:
                outside = ~token_mask(packed.cu_seqlens_q, q.shape[2])
            buffer.masked_fill_(outside.view(1, 1, -1, *(1,) * (buffer.dim() - 3)), fill)
    if out.numel() and shape.batch and shape.seqlen_q:  # (no key is for the kernel: O = 0, LSE = -inf)
        kernel_out = out
        if dims != (d_qk, d_v):  # flashkiln.head_dims: zero-padded copies, O copied back
            q, k, v = padded(q, dims[0]), padded(k, dims[0]), padded(v, dims[1])
            kernel_out = (torch.zeros if packed is not None else torch.empty)((*q.shape[:3], dims[1]), dtype=q.dtype,
                                                                              device=q.device)
        q, k, v = (inputs.kernel_layout(t) for t in (q, k, v))
        launch = plan_if_hopper(backend, q, k, v, kernel_out, lse, causal_mode, scale, kernel_bias, kernel_sink,
                                packed, target, registry)
        run(registry, target, [launch or plan_forward(q, k, v, kernel_out, lse, causal_mode, scale, kernel_bias,
                                                      target.capability, registry, kernel_sink, packed)])
        if kernel_out is not out:
            out.copy_(kernel_out[..., :d_v])
    if packed is not None:
        out, lse = as_tokens(out), as_tokens(lse)
    return out, lse

