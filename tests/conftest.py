"""Test-process set-up, before JAX is imported.

* The long poles first: optax's own ``test_optimizers`` (30,000 steps of each named
  optimizer in one scan, ``tests/test_optax_common.py``) run before everything else, so a
  parallel run (``pytest -n N``) starts them first instead of ending on them. On an H100
  the longest took 190 s (about 6 ms a step, with a refresh every 2 steps then: small
  decompositions one kernel launch after another), against about 1 s on a CPU.
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


def pytest_collection_modifyitems(config, items):
  """Moves optax's ``test_optimizers`` cases, the suite's longest on an accelerator, to
  the front (a stable sort: every other test keeps its order)."""
  del config
  items.sort(key=lambda item: 0 if "test_optax_contrib_common" in item.name
             and "-test_optimizers-" in item.name else 1)
