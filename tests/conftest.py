"""Shared fixtures. Multi-device tests set XLA_FLAGS themselves in a subprocess."""

import numpy as np
import pytest


def structured_grads(shape, steps, seed=0, noise=0.3):
  """Gradients with a stable, well-separated singular spectrum plus noise (numpy, float64).

  ``shape`` may carry leading batch axes; each matrix slice gets its own structure.
  """
  rng = np.random.default_rng(seed)
  *batch, m, n = shape
  k = min(m, n)
  nb = int(np.prod(batch)) if batch else 1
  base = []
  for _ in range(nb):
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    s = 4.0 * 0.6 ** np.arange(k)
    base.append(u @ np.diag(s) @ v.T)
  base = np.stack(base).reshape(tuple(batch) + (m, n))
  out = []
  for _ in range(steps):
    out.append(base + noise * rng.standard_normal(base.shape))
  return out


@pytest.fixture
def grads_fn():
  return structured_grads
