"""Constants that the runtime mirrors from the C++ headers, checked where the kernels see them: each
unit renders one static_assert per constant (templates/abi_check.j2), so a header and its Python
mirror that drift apart fail the compile, like the parameter blocks' layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashkiln.archs import ARCHS
from flashkiln.params import BATCH_INNER, BWD_CONSUMER_WARPGROUPS, DQ_ACCUM_ROW_ALIGN, HEADS_INNER, QUERY_TILES_INNER
from flashkiln.tma import BOX_COLS, head_box_cols


@dataclass(frozen=True)
class Constant:
    cpp: str  # a constant expression of the unit (`Traits`: a variant's traits)
    value: int
    python: str  # where the runtime's value lives


def abi_constants(family: str, kernel: str, arch: str) -> dict[str, list[Constant]]:
    """The constants of a unit whose headers declare them: "unit" at namespace scope, "traits" once
    per variant beside its traits. Every unit includes common/sequence.hpp; the hopper forward
    also hopper/tile_scheduler.hpp and hopper/fwd_traits.hpp, its backward hopper/bwd_traits.hpp
    and its dBias kernel hopper/bwd_dbias.hpp (each with hopper/head_boxes.hpp), and its
    postprocess hopper/bwd_dq_tiles.hpp."""
    unit = [Constant("flashkiln::kDqAccumRowAlign", DQ_ACCUM_ROW_ALIGN, "flashkiln.params.DQ_ACCUM_ROW_ALIGN")]
    traits = []
    if family == "hopper" and kernel in ("fwd", "bwd", "bwd_dbias"):
        # The head dims' box rule (hopper/head_boxes.hpp), at every multiple of 32 up to 256, whole
        # or split between the backward's warpgroups.
        unit += [Constant(f"flashkiln::hopper::head_box_cols({d}, {parts})", head_box_cols(d, parts),
                          f"flashkiln.tma.head_box_cols({d}, {parts})")
                 for d in range(32, 257, 32) for parts in (1, BWD_CONSUMER_WARPGROUPS)]
    if family == "hopper" and kernel == "fwd":
        unit += [
            Constant("int(flashkiln::hopper::kQueryTilesInner)", QUERY_TILES_INNER,
                     "flashkiln.params.QUERY_TILES_INNER"),
            Constant("int(flashkiln::hopper::kHeadsInner)", HEADS_INNER, "flashkiln.params.HEADS_INNER"),
            Constant("int(flashkiln::hopper::kBatchInner)", BATCH_INNER, "flashkiln.params.BATCH_INNER"),
        ]
        traits += [
            Constant("Traits::kBoxCols", BOX_COLS, "flashkiln.tma.BOX_COLS"),
            Constant("Traits::kMaxSmemBytes", ARCHS[arch].max_smem_per_block,
                     f"flashkiln.archs.ARCHS['{arch}'].max_smem_per_block"),
        ]
    if family == "hopper" and kernel in ("bwd", "bwd_post", "bwd_dbias"):
        unit.append(Constant("flashkiln::hopper::kBwdConsumerWarpgroups", BWD_CONSUMER_WARPGROUPS,
                             "flashkiln.params.BWD_CONSUMER_WARPGROUPS"))
    if family == "hopper" and kernel in ("bwd", "bwd_dbias"):
        traits += [
            Constant("Traits::kBoxCols", BOX_COLS, "flashkiln.tma.BOX_COLS"),
            Constant("Traits::kMaxSmemBytes", ARCHS[arch].max_smem_per_block,
                     f"flashkiln.archs.ARCHS['{arch}'].max_smem_per_block"),
        ]
    return {"unit": unit, "traits": traits}
