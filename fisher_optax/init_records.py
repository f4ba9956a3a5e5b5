"""What a transformation's ``init`` saw, recorded while a caller traces ``tx.init``.

Wrappers such as ``optax.chain``, ``optax.inject_hyperparams`` and ``optax.MultiSteps``
hide their inner transformations in closures; tracing ``tx.init`` with
``jax.eval_shape`` reaches every one of them. An inner transformation's ``init`` adds a
record to each open block of its :class:`Records`, which is how ``fisher_optax.describe``
and ``fisher_optax.convert_state_layout`` see through the wrappers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


class Records:
  """The open recording blocks of one kind of ``init``."""

  def __init__(self):
    self._open: list = []

  @contextlib.contextmanager
  def recording(self) -> Iterator[list]:
    """Within the block, every :meth:`add` appends to the yielded list."""
    found: list = []
    self._open.append(found)
    try:
      yield found
    finally:
      self._open.remove(found)

  def add(self, record: Callable[[], Any]) -> None:
    """Appends ``record()`` to every open block (called only where one is open)."""
    for found in self._open:
      found.append(record())
