"""Building blocks: one module per structural approximation (docs: "Building blocks and
composition").

The refresh policies that :func:`low_rank_track` takes (``switch``, ``subspace_refresh``,
``svd_refresh``) are static configuration, not transformations; they live below the blocks
in :mod:`fisher_optax.refresh`."""

from fisher_optax.blocks.compensate import CompensateState, compensate
from fisher_optax.blocks.limiter import NormGrowthLimiterState, limit_growth, norm_growth_limiter
from fisher_optax.blocks.low_rank import LowRankTrackLargerState, LowRankTrackState, low_rank_track
from fisher_optax.blocks.power import PowerTrackState, power_track
from fisher_optax.blocks.subspace import (OnCoefficientsState, Subspace, SubspaceGuard,
                                          in_subspace, on_coefficients, project_back)
from fisher_optax.blocks.moments import (ScaleByBiasCorrectionState, ScaleByMomentsState,
                                         scale_by_bias_correction, scale_by_moments)
from fisher_optax.blocks.two_sided import ScaleByTwoSidedState, scale_by_two_sided
from fisher_optax.blocks.rotate import RotateSideState, RotateState, rotate
from fisher_optax.blocks.rotate_owned import RotateLocalState, RotateOwnedState
from fisher_optax.blocks.random_projection import (RandomProjectState, random_project,
                                                   scale_by_subspace_ratio)
from fisher_optax.blocks.momentum import ScaleByMomentumState, scale_by_momentum
from fisher_optax.blocks.normalize import normalize
from fisher_optax.blocks.row_moments import (ScaleByRowMomentsState, scale_by_row_moments,
                                             scale_to_rms)
from fisher_optax.blocks.whiten import scale_by_shape, whiten
