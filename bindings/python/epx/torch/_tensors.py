"""torch.Tensor <-> epx._C.Ref, and the stream an op runs on.

A Ref is a view (pointer, dtype, shape, device) of memory torch owns: the caller keeps the
tensor alive for as long as epx may touch it (the ops below hold their inputs and outputs for the
duration of the call; the MoE module holds its parameters).
"""
import torch

from .. import _C

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPE_NAMES[torch.float8_e8m0fnu] = "e8m0"
_TORCH_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

NONE = _C.Ref(0, "fp32", [], -1)  # "not given" for optional arguments


def torch_dtype(name):
    return _TORCH_DTYPES[name]


def epx_dtype(dtype):
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"epx: dtype {dtype} is not supported, expected one of "
                         f"{', '.join(str(d) for d in _DTYPE_NAMES)}") from None


def ref(t, name="tensor", fn="epx"):
    """The Ref of a contiguous tensor (None -> NONE)."""
    if t is None:
        return NONE
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} is a {type(t).__name__}, expected a torch.Tensor")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} with shape {list(t.shape)} and strides {list(t.stride())} is not "
                         f"contiguous, expected a contiguous tensor (call .contiguous())")
    if t.dim() > 4:
        raise ValueError(f"{fn}: {name} has {t.dim()} dimensions, expected at most 4")
    if t.is_cuda:
        device = t.device.index
    elif t.device.type == "cpu":
        device = -1
    else:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected a CUDA or CPU tensor")
    return _C.Ref(t.data_ptr(), epx_dtype(t.dtype), list(t.shape), device)


def stream_of(t):
    """The current torch stream of t's device as an integer cudaStream_t (0 for CPU tensors)."""
    if t is not None and t.is_cuda:
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


class _CudaArray:
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "version": 3, "stream": None}


_TYPESTR = {"int32": "<i4", "int64": "<i8", "fp32": "<f4", "fp64": "<f8", "uint8": "|u1"}


def alias(r):
    """A torch tensor over the memory a Ref describes (no copy; for epx-owned buffers of plain
    dtypes such as a handle's offsets). Valid while epx keeps that memory."""
    ptr, dtype, shape, device = r.describe()
    if device < 0:
        import ctypes
        n = 1
        for d in shape:
            n *= d
        buf = (ctypes.c_byte * (n * torch.empty((), dtype=torch_dtype(dtype)).element_size())).from_address(ptr)
        return torch.frombuffer(buf, dtype=torch_dtype(dtype)).view(shape) if n else torch.empty(shape, dtype=torch_dtype(dtype))
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, shape, _TYPESTR[dtype]), device=f"cuda:{device}")
