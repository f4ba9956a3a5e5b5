"""Shared fixtures. The test process gets 8 CPU devices (set before JAX is imported) so
that sharded runs are tested on CPU; single-device code keeps using device 0."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


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
