"""CuTe DSL kernels for Hopper (sm_90a).

`gdn_decode` runs one Gated Delta Net decode step over a bf16 or fp32 state pool (docs/protocol.md,
section 4, for the math; `_decode_kernel` for the layout contract). Importing this
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

__all__ = [
    "CHECKED_HEADS",
    "HEAD_DIM",
    "SUPPORTED_T",
    "UNROLLED_T",
    "Variant",
    "check_variant",
    "compile_all_variants",
    "compile_variant",
    "default_variant",
    "gdn_decode",
    "validate_decode_args",
]
