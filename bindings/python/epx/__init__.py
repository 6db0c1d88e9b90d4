"""epx: Mixture-of-Experts layers with expert parallelism.

`epx` is the C++ library's API for Python (configs, groups, ops on raw tensor views);
`epx.torch` builds PyTorch ops (torch.library custom ops with autograd, fake kernels for
torch.compile) and the `epx.torch.MoE` module on top of it.
"""
from . import _C
from ._C import (  # noqa: F401  (re-exported)
    Activation,
    AuxLossType,
    DropPolicy,
    DType,
    GroupConfig,
    MlpConfig,
    MlpPrecision,
    MoEConfig,
    ParamStorage,
    PrepareOptions,
    RouterConfig,
    ScoreFunction,
    Transport,
    find_preset,
    known_env_names,
    moe_config,
    preset_names,
    registered_bytes_per_rank,
    unknown_env_names,
)

__all__ = ["Activation", "AuxLossType", "DropPolicy", "DType", "GroupConfig", "MlpConfig", "MlpPrecision", "MoEConfig",
           "ParamStorage", "PrepareOptions", "RouterConfig", "ScoreFunction", "Transport", "find_preset",
           "known_env_names", "moe_config", "preset_names", "registered_bytes_per_rank", "unknown_env_names"]
__version__ = _C.__version__
cuda_backend = _C.cuda_backend
