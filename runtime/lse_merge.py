"""Merging partial attention results through their log-sum-exps.

Attention of a query row over keys K1 ∪ K2 is a weighted mean of its attention over K1 and over
K2: O = (e^{L1} O1 + e^{L2} O2) / (e^{L1} + e^{L2}) and L = log(e^{L1} + e^{L2}), computed
relative to max(L1, L2) so that nothing overflows. A row that has seen no key has L = -inf and
O = 0 (the kernels' convention), and keeps them through any number of merges without a NaN.
"""
from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one partial result (part_out (..., S, d), part_lse (..., S)) into the running (out, lse),
    in place. out and lse are the accumulators (fp32, or fp64 for fp64 inputs), possibly views of
    some rows of larger ones; start them at 0 and -inf."""
    peak = torch.maximum(lse, part_lse)
    peak = peak.masked_fill(torch.isneginf(peak), 0.0)  # rows neither has seen: weights 0, not NaN
    kept = torch.exp(lse - peak)
    added = torch.exp(part_lse - peak)
    total = kept + added
    lse.copy_(peak + torch.log(total))  # log(0) = -inf for a row neither has seen
    # Wherever a row has seen a key, the larger weight is exp(0) = 1, so total >= 1 and the clamp
    # changes only the rows whose weights are both 0 (leaving their O at 0).
    total = total.clamp_min(1.0)
    out.mul_((kept / total).unsqueeze(-1)).add_(part_out * (added / total).unsqueeze(-1))
