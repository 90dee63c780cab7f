"""CuTe DSL kernels for Hopper (sm_90a).

`gdn_decode` runs one Gated Delta Net decode step over a bf16 or fp32 state pool (docs/protocol.md,
section 4, for the math; `_decode_kernel` for the layout contract). `ring_verify` runs a speculative
step that writes only the rows' history rings (folding a full one first), `ring_fold` folds rings
into their states (`_ring_kernel`, `_ring_api`). `segments_scan` and `segments_copy` check and
copy tensors by address, for a client's shared memory (`_segments`). Importing this
package is cheap and needs no GPU: cutlass loads on the first compile. On a machine without
a GPU, `compile_variant` / `compile_all_variants` compile for CUTE_DSL_ARCH=sm_90a.
"""
from ._api import (
    CHECKED_HEADS,
    HEAD_DIM,
    SUPPORTED_T,
    UNROLLED_T,
    Variant,
    check_variant,
    compile_all_variants,
    compile_variant,
    default_variant,
    gdn_decode,
    validate_decode_args,
)
from ._ring_api import (
    compile_ring, folded_base, new_ring, ring_bytes_per_row, ring_dtypes, ring_fold, ring_variants, ring_verify,
)
from ._segments import SEGMENT_FIELDS, SegmentTable, TensorScan, compile_segment_kernels, compiled_segments, segments_copy, segments_scan

__all__ = [
    "CHECKED_HEADS",
    "HEAD_DIM",
    "SEGMENT_FIELDS",
    "SUPPORTED_T",
    "SegmentTable",
    "TensorScan",
    "UNROLLED_T",
    "Variant",
    "check_variant",
    "compile_ring",
    "compile_all_variants",
    "compile_variant",
    "compile_segment_kernels",
    "compiled_segments",
    "default_variant",
    "folded_base",
    "gdn_decode",
    "new_ring",
    "ring_bytes_per_row",
    "ring_dtypes",
    "ring_fold",
    "ring_variants",
    "ring_verify",
    "segments_copy",
    "segments_scan",
    "validate_decode_args",
]
