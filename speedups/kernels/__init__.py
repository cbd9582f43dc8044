"""How the step's kernels run: reproducibly (:func:`deterministic`) or fast (:func:`fast_kernels`), and
compiled by block name (:func:`compile_blocks`)."""

from speedups.kernels.compiling import compile_blocks, compiled_blocks, uncompile_blocks
from speedups.kernels.fast import fast_kernels
from speedups.kernels.reproducible import CUBLAS_CONFIG, deterministic

__all__ = [
    "CUBLAS_CONFIG",
    "compile_blocks",
    "compiled_blocks",
    "deterministic",
    "fast_kernels",
    "uncompile_blocks",
]
