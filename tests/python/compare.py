"""What the Python tests compare GPU results against the CPU reference with."""
import numpy as np


def rel_err(a, b):
    """||a - b|| / ||b|| in fp64, for torch tensors and JAX / NumPy arrays alike: the bf16 GPU layer
    rounds where the CPU reference keeps fp32, so the comparison is by norm (as `epx demo`'s
    reference check does), not element by element."""
    a, b = _f64(a), _f64(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _f64(t):
    if hasattr(t, "detach"):  # torch: NumPy has no bf16
        return t.detach().cpu().double().numpy()
    return np.asarray(t, np.float64)
