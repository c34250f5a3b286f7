"""The portable family: mma.sync kernels (templates/include/flashkiln/portable), for sm_80 and later."""
from __future__ import annotations

from flashkiln.archs import ARCHS
from flashkiln.descriptor import VariantDescriptor
from flashkiln.params import DQ_ACCUM_ROW_ALIGN

from .base import ELEMENT_BYTES, Family, smem_limit_errors


def _row_warps(rows: int, cols: tuple[int, ...], warps: int) -> int:
    """Mirror of row_warps() in portable/bwd_traits.hpp: warps splitting an accumulator's rows."""
    wm = max(1, min(rows // 32, warps))
    while wm < warps and (rows % (16 * wm) or any(c % (16 * (warps // wm)) for c in cols)):
        wm *= 2
    return wm


def _gmem_rows_per_pass(threads: int, dim: int) -> int:
    """Rows one pass of 16-byte copies covers: each row is split among (swizzle atom width / 8) threads."""
    return threads // ((64 if dim % 64 == 0 else 32) // 8)


class PortableFamily(Family):
    """The forward and every backward kernel, on any target (all are sm_80 or later)."""

    name = "portable"
    archs = tuple(ARCHS)
    arch_needs = "mma.sync and cp.async"
    kernels = {"fwd": "portable_fwd.cu.j2", "bwd_pre": "portable_bwd_rows.cu.j2", "bwd": "portable_bwd.cu.j2",
               "bwd_post": "portable_bwd_rows.cu.j2", "bwd_dq": "portable_bwd_dq.cu.j2"}
    ROW_KERNELS = ("bwd_pre", "bwd_post")
    # bwd_dq reads the dS tiles that bwd writes, tile by tile.
    shared_tiles = {"bwd_dq": ("bwd", ("tile_m", "tile_n"))}

    def smem_bytes(self, d: VariantDescriptor) -> int:
        elem = ELEMENT_BYTES[d.dtype]
        bias_tile = d.tile_m * d.tile_n if d.bias != "none" else 0
        if d.kernel == "fwd":
            # Q (reused for O), then `stages` buffers of one K and one V tile, then one bias tile.
            return elem * (d.tile_m * max(d.d_qk, d.d_v) + d.stages * d.tile_n * (d.d_qk + d.d_v) + bias_tile)
        if d.kernel == "bwd":
            # `stages` x (Q, dO, bias), K and V, then P and dS.
            return elem * (d.stages * (d.tile_m * (d.d_qk + d.d_v) + bias_tile) + d.tile_n * (d.d_qk + d.d_v)
                           + 2 * d.tile_m * d.tile_n)
        if d.kernel == "bwd_dq":
            # `stages` x (dS tile, K tile).
            return elem * d.stages * (d.tile_m * d.tile_n + d.tile_n * d.d_qk)
        return 0

    def combination_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.kernel != "bwd" and d.deterministic:
            errors.append(f"deterministic=true: {d.kernel} is deterministic by construction; only bwd has the axis")
        if d.kernel in self.ROW_KERNELS and d.causal != "none":
            errors.append(f"causal={d.causal}: {d.kernel} does not mask; list it with causal: [none]")
        if d.kernel not in ("fwd", "bwd") and d.bias != "none":
            errors.append(f"bias={d.bias}: {d.kernel} does not read the bias; list it with bias: [none]")
        if d.packed:
            errors.append("packed=true: portable kernels read the sequence bounds at run time, so their "
                          "packed=false kernels take packed batches too")
        if d.bias_grad:
            errors.append("bias_grad=true: the portable backward gives dBias through its workspace route; "
                          "list bias_grad: [false]")
        return errors

    def tuning_errors(self, d: VariantDescriptor) -> list[str]:
        if d.kernel in self.ROW_KERNELS:
            return self._row_tuning_errors(d)
        return self._tile_tuning_errors(d)

    def _row_tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.warps not in (1, 2, 4, 8):
            errors.append(f"warps={d.warps}: must be 1, 2, 4 or 8")
        if d.tile_m != 4 * d.warps:
            errors.append(f"tile_m={d.tile_m}: {d.kernel} handles 4 rows per warp, so tile_m must be {4 * d.warps}")
        if (d.tile_n, d.stages) != (1, 1):
            errors.append(f"tile_n={d.tile_n}, stages={d.stages}: {d.kernel} has neither; both must be 1")
        return errors

    def _tile_tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        warps = (1, 2, 4, 8) if d.kernel == "fwd" else (4, 8)
        if d.warps not in warps:
            errors.append(f"warps={d.warps}: must be one of {', '.join(map(str, warps))}")
        if d.stages not in (1, 2):
            errors.append(f"stages={d.stages}: must be 1 or 2")
        if d.kernel == "fwd":
            if d.tile_m % (16 * d.warps):
                errors.append(f"tile_m={d.tile_m}: must be a multiple of 16 * warps = {16 * d.warps}")
            if d.tile_n % 16:
                errors.append(f"tile_n={d.tile_n}: must be a multiple of 16")
        else:
            errors += self._bwd_warp_grid_errors(d)
        if d.kernel != "fwd" or d.bias != "none":
            # dS and bias tiles move between global and shared memory as tile_n-wide 16-byte copies.
            rows_per_pass = _gmem_rows_per_pass(self.threads(d), d.tile_n)
            if d.tile_n % 32:
                errors.append(f"tile_n={d.tile_n}: score tiles (bias, dS) need a multiple of 32")
            elif d.tile_m % rows_per_pass:
                errors.append(f"tile_m={d.tile_m}: must be a multiple of {rows_per_pass} (rows one pass of "
                              f"{self.threads(d)} threads copies of a {d.tile_n}-wide score tile)")
        for dim in {d.d_qk, d.d_v}:
            rows_per_pass = _gmem_rows_per_pass(self.threads(d), dim)
            for tile_name, rows in (("tile_m", d.tile_m), ("tile_n", d.tile_n)):
                if rows % rows_per_pass:
                    errors.append(f"{tile_name}={rows}: must be a multiple of {rows_per_pass} "
                                  f"(rows one pass of {self.threads(d)} threads copies at head dim {dim})")
        errors += smem_limit_errors(d, self.smem_bytes(d))
        return sorted(set(errors))

    def _bwd_warp_grid_errors(self, d: VariantDescriptor) -> list[str]:
        if d.tile_m % 16 or d.tile_n % 32:
            return [f"tile {d.tile_m}x{d.tile_n}: bwd needs tile_m a multiple of 16 and tile_n of 32"]
        errors = []
        if DQ_ACCUM_ROW_ALIGN % d.tile_m:
            errors.append(f"tile_m={d.tile_m}: must divide {DQ_ACCUM_ROW_ALIGN}, the dQ accumulator's rows per "
                          "sequence are rounded up to that")
        gemms = (("dQ", d.tile_m, (d.d_qk,)),)
        if d.kernel == "bwd":
            gemms = (("S = Q K^T", d.tile_m, (d.tile_n,)), ("dK, dV", d.tile_n, (d.d_qk, d.d_v))) + gemms
        for what, rows, cols in gemms:
            wm = _row_warps(rows, cols, d.warps)
            if rows % (16 * wm) or any(c % (16 * (d.warps // wm)) for c in cols):
                errors.append(f"tile {d.tile_m}x{d.tile_n} with {d.warps} warps does not split the {what} "
                              f"accumulator ({rows} x {'/'.join(map(str, cols))}) into 16 x 16 warp tiles")
        return errors
