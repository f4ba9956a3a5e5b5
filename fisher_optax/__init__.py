"""fisher_optax: memory-efficient optimizers from structured Fisher approximation.

Public API only (re-exports). The paper: "Towards Efficient Optimizer Design for LLM
via Structured Fisher Approximation with a Low-Rank Extension", arXiv:2502.07752.
"""

from fisher_optax._version import __version__
from fisher_optax.alias import (alice, alice0, alice_soap, apollo, apollo_mini,
                                default_leading, dion, eigen_adam, fira, galore,
                                inject_hyperparams, muon, normuon, racs, shampoo, soap,
                                swan)
from fisher_optax.blocks import (CompensateState, LowRankTrackLargerState, LowRankTrackState,
                                 NormGrowthLimiterState,
                                 OnCoefficientsState, PowerTrackState, RandomProjectState,
                                 RotateLocalState, RotateOwnedState, RotateSideState,
                                 RotateState, ScaleByBiasCorrectionState,
                                 ScaleByMomentsState, ScaleByMomentumState,
                                 ScaleByRowMomentsState, ScaleByTwoSidedState, Subspace,
                                 SubspaceGuard, compensate, in_subspace, low_rank_track,
                                 norm_growth_limiter, normalize, on_coefficients, power_track,
                                 project_back, random_project, rotate,
                                 scale_by_bias_correction, scale_by_moments,
                                 scale_by_momentum, scale_by_row_moments, scale_by_shape,
                                 scale_by_subspace_ratio, scale_to_rms, scale_by_two_sided,
                                 whiten)
from fisher_optax.equinox_dims import EquinoxDims, equinox_dims
from fisher_optax.flax_dims import FlaxDims, flax_dims, linen_dims
from fisher_optax.haiku_dims import HaikuDims, haiku_dims
from fisher_optax.inspect.describe import Description, describe
from fisher_optax.inspect.memory import paper_state_numbers, state_bytes, state_numbers
from fisher_optax.matrices import (EMBEDDING, NOT_A_MATRIX, DimsRule, Embedding, MatrixDims,
                                   Unclassified)
from fisher_optax.model_dims import ModelDims, einsum_dims
from fisher_optax.owned_stacks import OwnedStacksState
from fisher_optax.parallel.explicit_axes import with_auto_axes
from fisher_optax.parallel.owners import GuessedSplitWarning, OwnerLayout, owner_layout
from fisher_optax.parallel.sharding import state_partition_specs, state_shardings
from fisher_optax.refresh import (SubspaceRefresh, SvdRefresh, Switch, subspace_refresh,
                                  svd_refresh, switch)
from fisher_optax.routing import (FallbackWarning, PathMask, default_mask, in_float32,
                                  path_mask)
from fisher_optax.stacking import convert_state_layout

__all__ = [
    # named optimizers
    "alice", "alice0", "alice_soap", "apollo", "apollo_mini", "dion", "eigen_adam", "fira",
    "galore", "muon", "normuon", "racs", "shampoo", "soap", "swan", "default_leading",
    "inject_hyperparams",
    # blocks
    "compensate", "in_subspace", "low_rank_track", "norm_growth_limiter", "normalize",
    "on_coefficients", "power_track", "project_back", "random_project", "rotate",
    "scale_by_bias_correction", "scale_by_moments", "scale_by_momentum",
    "scale_by_row_moments", "scale_by_shape", "scale_by_subspace_ratio", "scale_to_rms",
    "scale_by_two_sided", "subspace_refresh", "svd_refresh",
    "switch", "whiten", "Subspace", "SubspaceGuard", "SubspaceRefresh", "SvdRefresh", "Switch",
    # states
    "CompensateState", "LowRankTrackLargerState", "LowRankTrackState",
    "NormGrowthLimiterState", "OnCoefficientsState", "OwnedStacksState",
    "PowerTrackState", "RandomProjectState", "RotateLocalState", "RotateOwnedState",
    "RotateSideState", "RotateState",
    "ScaleByBiasCorrectionState", "ScaleByMomentsState", "ScaleByMomentumState",
    "ScaleByRowMomentsState", "ScaleByTwoSidedState",
    # matrix dims, routing, inspection, parallelism
    "DimsRule", "EMBEDDING", "Embedding", "EquinoxDims", "FallbackWarning", "FlaxDims", "HaikuDims", "MatrixDims",
    "ModelDims", "NOT_A_MATRIX", "PathMask", "Unclassified", "default_mask", "einsum_dims",
    "equinox_dims", "flax_dims", "haiku_dims", "linen_dims", "in_float32", "path_mask",
    "Description", "describe", "paper_state_numbers", "state_bytes", "state_numbers",
    "state_partition_specs", "state_shardings", "with_auto_axes", "GuessedSplitWarning",
    "OwnerLayout", "owner_layout", "convert_state_layout",
]
