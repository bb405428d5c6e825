"""The Triton kernel's parameters (`triton_kernel.py`), declared once: legal values and the
rules its `tl.static_assert`s and tile shapes impose. Importing this does not import Triton."""
from __future__ import annotations

from .params import Declaration, Param, declared
from .shapes import next_pow2

TRITON_PARAMS = Declaration("TritonParams", [
    Param("NSPLIT", range(1, 257), 16, "key-range splits per request (the stage-1 grid's split count)", launch=True),
    Param("BLOCK_N", (16, 32, 64, 128, 256), 32, "keys per tile"),
    Param("HEADS_PER_BLOCK", range(1, 65), 2,
          "heads per program; the tile has next_pow2(HEADS_PER_BLOCK * T) rows, at least 16 (tl.dot)"),
    Param("NUM_WARPS", (1, 2, 4, 8, 16), 4, "Triton's num_warps"),
    Param("STAGES", range(1, 6), 2, "Triton's num_stages"),
], rules=[
    ("rows_per_tile", "HEADS_PER_BLOCK", "max(16, next_pow2(HEADS_PER_BLOCK * T)) <= 256",
     "HEADS_PER_BLOCK * T rows per tile exceed 256"),
])


@declared(TRITON_PARAMS)
class TritonParams:
    """Compile-time parameters of the Triton kernel (NSPLIT is the stage-1 grid's split count);
    fields, legal values and defaults: `TRITON_PARAMS`."""

    def block_m(self, T: int) -> int:
        """Rows of the stage-1 tile: HEADS_PER_BLOCK*T padded to a power of two (>= 16 for tl.dot)."""
        return max(16, next_pow2(self.HEADS_PER_BLOCK * T))

    def smem_bytes(self, T: int, Dk: int) -> int:
        """Shared memory of the stage-1 kernel: the bf16 Q tile and one bf16 key tile, all Dk
        columns. Triton 3.6's sm_120 compiles of this kernel report exactly this for STAGES 1-3
        up to 64 rows (it does not multiply the key tile by the stages), and 2 KB more at 128
        rows: a lower bound that the compile itself has the last word on."""
        return (self.block_m(T) + self.BLOCK_N) * Dk * 2
