"""Named optimizers: short chains of blocks, as optax builds its aliases from its
transforms. No math here.

One module per family of blocks: :mod:`~fisher_optax.alias.two_sided` (RACS),
:mod:`~fisher_optax.alias.low_rank` (Alice and its variants, Dion),
:mod:`~fisher_optax.alias.projection` (GaLore, Fira, APOLLO),
:mod:`~fisher_optax.alias.rotation` (Eigen-Adam, SOAP, Shampoo) and
:mod:`~fisher_optax.alias.whitening` (SWAN, Muon, NorMuon); every chain is closed by
:func:`~fisher_optax.alias.closing.finish` below them.

Each returns an ``optax.GradientTransformationExtraArgs`` that applies the
structured rule to the leaves selected by ``mask`` (default: matrices, see
:func:`~fisher_optax.default_mask`) and ``fallback`` (default
``optax.adam(learning_rate)`` run in float32, :func:`fisher_optax.routing.in_float32`)
to the others. Defaults are the paper's 130M settings (App. "Experiment details").
"""

from fisher_optax.alias.closing import inject_hyperparams
from fisher_optax.alias.low_rank import alice, alice0, alice_soap, default_leading, dion
from fisher_optax.alias.projection import apollo, apollo_mini, fira, galore
from fisher_optax.alias.rotation import MAX_PRECOND_DIM, eigen_adam, shampoo, soap
from fisher_optax.alias.two_sided import racs
from fisher_optax.alias.whitening import muon, normuon, swan

FAMILIES = ("two_sided", "low_rank", "projection", "rotation", "whitening")

__all__ = ["alice", "alice0", "alice_soap", "apollo", "apollo_mini", "default_leading", "dion",
           "eigen_adam", "fira", "galore", "inject_hyperparams", "muon", "normuon", "racs",
           "shampoo", "soap", "swan", "MAX_PRECOND_DIM", "FAMILIES"]
