"""Test-process set-up, before JAX is imported.

* 8 CPU devices, so that sharded runs are tested on CPU; single-device code keeps using
  device 0.
* XLA:CPU compiled for compile time: the tests compile hundreds of small programs and
  run each a few steps, so code generation costs more than it saves. Backend
  optimisation level 0 and the older (non-"fusion emitter") kernel generator together
  take three heavy tests from 27 s to 16 s on 2 cores. This changes how the tests'
  programs are compiled for this CPU, not the library; a flag the caller's
  ``XLA_FLAGS`` already names wins. The XLA of jaxlib 0.11.2 no longer knows the
  fusion-emitter flag (0.10.2's does) and aborts on an unknown flag, so the flag goes to
  jaxlib below 0.11 only.
"""

import importlib.metadata
import os

_FLAGS = {"--xla_force_host_platform_device_count": "8",
          "--xla_backend_optimization_level": "0"}
try:
  _JAXLIB = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
  _JAXLIB = (0, 0)
if _JAXLIB < (0, 11):
  _FLAGS["--xla_cpu_use_fusion_emitters"] = "false"
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given.strip()] + [f"{k}={v}" for k, v in _FLAGS.items() if k not in _given]).strip()


def pytest_configure(config):
  """``FISHER_OPTAX_TEST_AUTO_LAYOUT=stacked`` (or ``per-leaf``) runs the suite with the
  named optimizers' default ``stack_matrices="auto"`` resolved to that layout whatever
  the backend: the layout ``"auto"`` gives on GPUs and TPUs, checked on a CPU."""
  del config
  layout = os.environ.get("FISHER_OPTAX_TEST_AUTO_LAYOUT")
  if not layout:
    return
  if layout not in ("stacked", "per-leaf"):
    raise ValueError(f"FISHER_OPTAX_TEST_AUTO_LAYOUT must be 'stacked' or 'per-leaf', got {layout!r}")
  from fisher_optax import stacking
  resolve = stacking.resolve
  stacking.resolve = lambda value: (layout == "stacked") if value == "auto" else resolve(value)
