"""torchrec_triton_tbe: FBGEMM's table-batched embedding (TBE) on Triton kernels, as a TorchRec plugin.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1 is set on
import unless the variable is already set); see torchrec_triton_tbe._env.
"""

from torchrec_triton_tbe import _env  # noqa: F401  (must precede every kernel import)
from torchrec_triton_tbe.config import KernelConfig, load_config  # noqa: F401
from torchrec_triton_tbe.module import TritonTBE  # noqa: F401

__version__ = "0.1.0"
__all__ = ["TritonTBE", "KernelConfig", "load_config"]
