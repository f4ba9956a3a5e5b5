"""fisher_optax: memory-efficient optimizers from structured Fisher approximation.

Public API only (re-exports). The paper: "Towards Efficient Optimizer Design for LLM
via Structured Fisher Approximation with a Low-Rank Extension", arXiv:2502.07752.
"""

from fisher_optax._version import __version__
from fisher_optax.blocks import (CompensateState, LowRankTrackState, NormGrowthLimiterState,
                                 OnCoefficientsState, ScaleByBiasCorrectionState,
                                 ScaleByMomentsState, ScaleByTwoSidedState, Subspace, Switch,
                                 SvdRefresh, compensate, low_rank_track, norm_growth_limiter,
                                 on_coefficients, project_back, RotateSideState, RotateState, rotate, scale_by_bias_correction,
                                 scale_by_moments, scale_by_two_sided, svd_refresh, switch)
from fisher_optax.blocks import random_project, scale_by_subspace_ratio, RandomProjectState
from fisher_optax.inspect.memory import paper_state_numbers, state_bytes, state_numbers
from fisher_optax.alias import (alice, alice0, alice_soap, apollo, apollo_mini,
                                default_leading, eigen_adam, fira, galore,
                                inject_hyperparams, muon, racs, shampoo, soap, swan)
from fisher_optax.blocks import (ScaleByMomentumState, normalize, scale_by_momentum,
                                 scale_by_shape, whiten)
from fisher_optax.matrices import NOT_A_MATRIX, DimsRule, MatrixDims
from fisher_optax.routing import PathMask, default_mask, in_float32, path_mask
from fisher_optax.inspect.describe import Description, describe
from fisher_optax.flax_dims import FlaxDims, flax_dims
from fisher_optax.parallel.sharding import state_partition_specs, state_shardings
from fisher_optax.parallel.explicit_axes import with_auto_axes


__all__ = [
    "alice", "alice0", "alice_soap", "fira", "galore", "racs", "eigen_adam", "soap", "shampoo",
    "apollo", "apollo_mini", "swan", "muon", "normalize", "whiten", "scale_by_momentum", "scale_by_shape",
    "ScaleByMomentumState", "inject_hyperparams", "rotate", "RotateState", "RotateSideState", "random_project",
    "scale_by_subspace_ratio", "RandomProjectState",
    "scale_by_two_sided", "norm_growth_limiter", "low_rank_track", "on_coefficients",
    "project_back", "compensate", "switch", "svd_refresh", "scale_by_moments",
    "scale_by_bias_correction", "Subspace", "Switch", "SvdRefresh",
    "with_auto_axes", "MatrixDims", "NOT_A_MATRIX", "default_mask", "path_mask", "in_float32", "describe",
    "Description", "flax_dims", "FlaxDims", "DimsRule", "PathMask", "default_leading",
    "state_partition_specs", "state_shardings",
    "state_bytes", "state_numbers", "paper_state_numbers",
    "CompensateState", "LowRankTrackState", "NormGrowthLimiterState", "OnCoefficientsState",
    "ScaleByBiasCorrectionState", "ScaleByMomentsState", "ScaleByTwoSidedState",
]
