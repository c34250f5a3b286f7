"""The hopper family (templates/include/flashkiln/hopper): TMA + wgmma, sm_90a only.

Forward (hopper/fwd_*.hpp): one producer warpgroup and one consumer warpgroup per 64 query rows;
K/V (and bias tiles, with a bias) stream through a ring of `stages` shared-memory buffers.
Backward (hopper/bwd_*.hpp): a CTA per key tile of tile_n keys and two consumer warpgroups, which
split it by keys (tile_n 128, 64 each) or, at d 256 and 192/128, by dK's and dV's columns
(tile_n 64), Q and dO of tile_m rows streaming through `stages` buffers; its postprocess
(bwd_post) reads the main kernel's dQ accumulator in 64-row tiles whose column parts follow the
head dim alone. The preprocess is the portable family's (bwd_pre). dBias of a bias shared by several
(batch entry, head) pairs (hopper/bwd_dbias.hpp): one CTA sums each (tile_m, tile_n) dBias tile of
a bias slice, and walks several such tiles where tiles have few members (persistent, at most one
CTA per SM); its two consumer warpgroups take 64 keys each, and K, V, Q and dO of each member
stream through `stages` buffers. The formulas here are static_asserted by the C++ side (threads,
shared-memory bytes), like the portable family's.
"""
from __future__ import annotations

from flashkiln.archs import ARCHS
from flashkiln.descriptor import VariantDescriptor
from flashkiln.params import BWD_CONSUMER_WARPGROUPS as _BWD_CONSUMER_WARPGROUPS
from flashkiln.params import bwd_column_parts
from flashkiln.tma import BOX_COLS as _BOX_COLS  # the bias's TMA box width in keys: one 128-byte swizzle atom

from .base import ELEMENT_BYTES, Family, smem_limit_errors

# Shared memory beyond the tiles: the mbarriers (rounded up to the 1024-byte alignment of the
# storage struct) and the slack for aligning the dynamic allocation to 1024 bytes.
_BARRIER_BLOCK = 1024
_ALIGN_SLACK = 1024 - 16


# The rows of the backward's dQ accumulator tiles (hopper/bwd_dq_tiles.hpp): bwd_post's tile_m,
# and what the main kernel's query tiles are made of.
_DQ_TILE_ROWS = 64
# The backward's head dims (d_qk, d_v). Where dK and dV of 64 keys (d_qk + d_v columns) fit a
# consumer warpgroup's registers, the warpgroups split a key tile of 128 by keys; else one of 64 by
# columns (hopper/bwd_traits.hpp). d 96, and d_qk 192 split in two, lie in 64-byte swizzled boxes
# (hopper/head_boxes.hpp), the others in 128-byte ones.
_BWD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
_BWD_KEY_SPLIT_COLUMNS = 256  # the most d_qk + d_v a warpgroup keeps for 64 keys (d 128)
# bwd_dbias's head dims: those the main kernel splits by keys (S^T and dP^T of 64 keys per warpgroup).
_DBIAS_HEAD_DIMS = (64, 96, 128)


class HopperFamily(Family):
    """Warp-specialized forward and backward for sm_90a (hopper/fwd_kernel.hpp, hopper/bwd_kernel.hpp)."""

    name = "hopper"
    archs = ("sm_90a",)
    arch_needs = "wgmma and setmaxnreg"
    kernels = {"fwd": "hopper_fwd.cu.j2", "bwd": "hopper_bwd.cu.j2", "bwd_post": "hopper_bwd_post.cu.j2",
               "bwd_dbias": "hopper_bwd_dbias.cu.j2"}
    shared_tiles = {}

    def consumer_warpgroups(self, d: VariantDescriptor) -> int:
        return d.tile_m // 64 if d.kernel == "fwd" else _BWD_CONSUMER_WARPGROUPS

    @staticmethod
    def bwd_tile_n(d: VariantDescriptor) -> int:
        """The main backward kernel's keys per CTA at d's head dim."""
        return 64 if d.d_qk + d.d_v > _BWD_KEY_SPLIT_COLUMNS else 64 * _BWD_CONSUMER_WARPGROUPS

    @staticmethod
    def splits_columns(d: VariantDescriptor) -> bool:
        """Whether the backward's consumers split dK's and dV's columns (BwdTraits::kSplitColumns)."""
        return d.kernel == "bwd" and bwd_column_parts(d.tile_n) > 1

    def smem_bytes(self, d: VariantDescriptor) -> int:
        if d.kernel == "bwd":
            return self._bwd_smem_bytes(d)
        if d.kernel == "bwd_dbias":
            return self._dbias_smem_bytes(d)
        if d.kernel == "bwd_post":
            return 0
        return self._smem_bytes(d, own_o=self.own_o_buffer(d), q_slots=self.q_slots(d))

    def dq_parts(self, d: VariantDescriptor) -> int:
        """dQ column parts per query tile: dq_tile_parts() in hopper/bwd_dq_tiles.hpp."""
        warpgroups = self.consumer_warpgroups(d)
        return warpgroups if d.d_qk // warpgroups >= 64 else 1

    def _bwd_smem_bytes(self, d: VariantDescriptor) -> int:
        """BwdTraits::SharedStorage: K, V, `stages` x (Q, dO), two dS buffers (and P^T's where the
        warpgroups split columns; with a bias split by keys, dS goes in the bias tiles and only a
        partial row sum per consumer warp and row stays, kDsInBiasTile), each warpgroup's dQ
        staging (fp32), then two buffers of row stats, the barriers and dSink's per-warp sums (with
        the empty NoBias's byte), rounded up to 1024 bytes, then with a bias `stages` bias tiles,
        and the alignment slack."""
        elem = ELEMENT_BYTES[d.dtype]
        bias = d.bias != "none"
        if bias and not self.splits_columns(d):
            ds = 4 * (4 * self.consumer_warpgroups(d)) * d.tile_m  # fp32, per consumer warp and row
        else:
            ds = elem * (3 if self.splits_columns(d) else 2) * d.tile_m * d.tile_n
        tiles = elem * (d.tile_n + d.stages * d.tile_m) * (d.d_qk + d.d_v) + -(-ds // 1024) * 1024
        dq_staging = 4 * self.consumer_warpgroups(d) * _DQ_TILE_ROWS * (d.d_qk // self.dq_parts(d))
        # K/V, Q/dO ring, dQ staging, dBias turns
        barriers = 8 * (1 + 2 * d.stages + 2 * self.consumer_warpgroups(d) + 2)
        stats_and_barriers = 2 * 3 * d.tile_m * 4 + barriers + 4 * 8 + (not bias)  # + dSink's per-warp sums
        bias_tiles = bias * elem * d.stages * d.tile_m * d.tile_n
        return tiles + dq_staging + -(-stats_and_barriers // 1024) * 1024 + bias_tiles + _ALIGN_SLACK

    @staticmethod
    def _dbias_smem_bytes(d: VariantDescriptor) -> int:
        """DbiasTraits::SharedStorage: `stages` x (Q, dO, K, V), two bias tiles, then two buffers of
        row stats (LSE, delta) and the barriers (2 x bias full and empty, `stages` x full and
        empty), rounded up to 1024 bytes, and the alignment slack."""
        elem = ELEMENT_BYTES[d.dtype]
        tiles = elem * (2 * d.stages * (d.tile_m + d.tile_n) * d.d_qk + 2 * d.tile_m * d.tile_n)
        stats_and_barriers = 2 * 2 * d.tile_m * 4 + 8 * (4 + 2 * d.stages)
        return tiles + -(-stats_and_barriers // 1024) * 1024 + _ALIGN_SLACK

    def own_o_buffer(self, d: VariantDescriptor) -> bool:
        """O gets its own shared-memory buffer (Q's then loads early) wherever it fits (fwd_traits.hpp)."""
        return self._fits(self._smem_bytes(d, own_o=True, q_slots=1), d)

    def q_slots(self, d: VariantDescriptor) -> int:
        """Two Q buffers (the next tile's Q loads a tile ahead) where they fit beside O's own (fwd_traits.hpp)."""
        two = self.consumer_warpgroups(d) == 3 and self.own_o_buffer(d)
        return 2 if two and self._fits(self._smem_bytes(d, own_o=True, q_slots=2), d) else 1

    @staticmethod
    def _fits(smem: int, d: VariantDescriptor) -> bool:
        return smem <= ARCHS[d.arch].max_smem_per_block

    def _smem_bytes(self, d: VariantDescriptor, own_o: bool, q_slots: int) -> int:
        elem = ELEMENT_BYTES[d.dtype]
        bias = d.bias != "none"
        tiles = elem * (q_slots * d.tile_m * d.d_qk + d.stages * d.tile_n * (d.d_qk + d.d_v)
                        + own_o * d.tile_m * d.d_v + bias * d.stages * d.tile_m * d.tile_n)
        # The bias ring's barriers take a block of their own (after its 1024-byte aligned tiles).
        return tiles + _BARRIER_BLOCK * (1 + bias) + _ALIGN_SLACK

    def combination_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.kernel == "fwd" and d.deterministic:
            errors.append("deterministic=true: the forward is deterministic by construction")
        if d.bias_grad and (d.kernel != "bwd" or d.bias == "none"):
            errors.append("bias_grad=true: only the backward's main kernel with a bias writes dBias")
        if d.kernel == "bwd_dbias":
            return errors + self._dbias_combination_errors(d)
        # Every head dim of the descriptor (a multiple of 32) is whole boxes of head_box_cols(d).
        if d.kernel != "fwd":
            return errors + self._bwd_combination_errors(d)
        if d.d_v > d.d_qk:
            errors.append(f"d_v={d.d_v} > d_qk={d.d_qk}: O is staged in Q's shared-memory buffer")
        return errors

    def _bwd_combination_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.deterministic:
            errors.append("deterministic=true: the hopper backward's one kernel serves deterministic calls too "
                          "(its dQ order is set at run time); list deterministic: [false]")
        if d.packed:
            errors.append("packed=true: the hopper backward reads a packed batch's sequence bounds at run time; "
                          "list packed: [false]")
        if (d.d_qk, d.d_v) not in _BWD_HEAD_DIMS:
            errors.append(f"d_qk={d.d_qk}, d_v={d.d_v}: the hopper backward has head dims 64, 96, 128 (dK and dV "
                          "of 64 keys stay in each consumer's registers), 192/128 and 256 (the consumers split "
                          "their columns)")
        if d.kernel == "bwd_post" and d.causal != "none":
            errors.append(f"causal={d.causal}: bwd_post does not mask; list it with causal: [none]")
        return errors

    @staticmethod
    def _dbias_combination_errors(d: VariantDescriptor) -> list[str]:
        errors = []
        if d.bias == "none":
            errors.append("bias=none: bwd_dbias sums a shared bias's dS; list it with bias: [additive]")
        if d.d_qk != d.d_v or d.d_qk not in _DBIAS_HEAD_DIMS:
            errors.append(f"d_qk={d.d_qk}, d_v={d.d_v}: bwd_dbias has head dims "
                          f"{', '.join(map(str, _DBIAS_HEAD_DIMS))} (the main kernel's split by keys)")
        for field, why in (("deterministic", "its sums are in a fixed order by construction"),
                           ("packed", "it runs dense batches only"), ("softcap", "a capped call has no bias")):
            if getattr(d, field):
                errors.append(f"{field}=true: bwd_dbias has none ({why}); list {field}: [false]")
        return errors

    def tuning_errors(self, d: VariantDescriptor) -> list[str]:
        if d.kernel == "bwd_dbias":
            return self._dbias_tuning_errors(d)
        if d.kernel != "fwd":
            return self._bwd_tuning_errors(d)
        errors = []
        if d.tile_m not in (64, 128, 192):
            errors.append(f"tile_m={d.tile_m}: must be 64, 128 or 192 (64 rows per consumer warpgroup)")
        else:
            warps = 4 * (1 + self.consumer_warpgroups(d))
            if d.warps != warps:
                errors.append(f"warps={d.warps}: tile_m={d.tile_m} needs {warps} (a producer warpgroup and "
                              f"{self.consumer_warpgroups(d)} consumer warpgroup(s))")
        if d.tile_n % 16 or not 16 <= d.tile_n <= 256:
            errors.append(f"tile_n={d.tile_n}: must be a multiple of 16 between 16 and 256 (wgmma N, TMA box)")
        if d.bias != "none" and d.tile_n % _BOX_COLS:
            errors.append(f"tile_n={d.tile_n}: with a bias, a multiple of {_BOX_COLS} (bias tiles load in "
                          f"{_BOX_COLS}-key TMA boxes)")
        if d.stages < 2:
            errors.append(f"stages={d.stages}: the K/V ring needs at least 2 buffers")
        return errors + smem_limit_errors(d, self.smem_bytes(d))

    def _dbias_tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.tile_n != 64 * _BWD_CONSUMER_WARPGROUPS:
            errors.append(f"tile_n={d.tile_n}: bwd_dbias's two consumer warpgroups take 64 keys each: "
                          f"{64 * _BWD_CONSUMER_WARPGROUPS}")
        if d.tile_m not in (64, 128):
            errors.append(f"tile_m={d.tile_m}: must be 64 or 128 (a consumer thread loads each row's LSE and delta)")
        if d.warps != 4 * (1 + _BWD_CONSUMER_WARPGROUPS):
            errors.append(f"warps={d.warps}: bwd_dbias needs {4 * (1 + _BWD_CONSUMER_WARPGROUPS)} (a producer "
                          "warpgroup and two consumers)")
        if d.stages < 2:
            errors.append(f"stages={d.stages}: the member pipeline needs at least 2 buffers")
        return errors + smem_limit_errors(d, self.smem_bytes(d))

    def _bwd_tuning_errors(self, d: VariantDescriptor) -> list[str]:
        errors = []
        if d.kernel == "bwd" and d.tile_n != self.bwd_tile_n(d):
            split = "by columns" if self.bwd_tile_n(d) == 64 else "by keys, 64 each"
            errors.append(f"tile_n={d.tile_n}: the hopper backward runs {self.bwd_tile_n(d)} keys per CTA at "
                          f"d_qk={d.d_qk} (two consumer warpgroups, split {split})")
        if d.kernel == "bwd_post" and d.tile_n != 1:
            errors.append(f"tile_n={d.tile_n}: bwd_post has no key tiles; must be 1")
        if d.kernel == "bwd" and d.tile_m not in (_DQ_TILE_ROWS, 2 * _DQ_TILE_ROWS):
            errors.append(f"tile_m={d.tile_m}: the hopper backward's query tiles are one or two {_DQ_TILE_ROWS}-row "
                          "dQ tiles")
        elif d.kernel == "bwd" and d.tile_m > _DQ_TILE_ROWS and self.dq_parts(d) != 1:
            errors.append(f"tile_m={d.tile_m} with d_qk={d.d_qk}: 128-row query tiles need a head dim of one "
                          "64-column dQ part (each consumer warpgroup adds one 64-row half; dK, dV, S and dP "
                          "of 128 rows at larger head dims exceed a consumer's registers)")
        if d.kernel == "bwd_post" and d.tile_m != _DQ_TILE_ROWS:
            errors.append(f"tile_m={d.tile_m}: bwd_post works on the accumulator's {_DQ_TILE_ROWS}-row dQ tiles")
        if d.kernel == "bwd":
            warps = 4 * (1 + _BWD_CONSUMER_WARPGROUPS)
            if d.warps != warps:
                errors.append(f"warps={d.warps}: bwd needs {warps} (a producer warpgroup and two consumers)")
            if self.splits_columns(d) and d.stages != 1:
                errors.append(f"stages={d.stages}: split columns take one Q/dO stage (P^T's buffer is reused once "
                              "the next tile's Q lands, and a second stage exceeds shared memory)")
            elif not self.splits_columns(d) and d.stages < 2:
                errors.append(f"stages={d.stages}: the Q/dO ring needs at least 2 buffers")
        else:
            if d.warps != 4:
                errors.append(f"warps={d.warps}: bwd_post runs a thread per thread of an m64 wgmma fragment: 4")
            if d.stages != 1:
                errors.append(f"stages={d.stages}: bwd_post has none; must be 1")
        return errors + smem_limit_errors(d, self.smem_bytes(d))
