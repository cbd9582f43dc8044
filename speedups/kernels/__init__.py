"""How the step's kernels run: reproducibly (:func:`deterministic`) or fast (:func:`fast_kernels`)."""

from speedups.kernels.fast import fast_kernels
from speedups.kernels.reproducible import CUBLAS_CONFIG, deterministic

__all__ = ["CUBLAS_CONFIG", "deterministic", "fast_kernels"]
