# The parallel layout (tp x dp x pp) and its rank arithmetic, as the runtime imports them: the one owner is the
# torch-free runtime/schema/parallel_dims.py (the launcher's estimator reads dp from it too, without torch).
from runtime.schema.parallel_dims import (AXES, CONTEXT_AXIS, EXPERT_AXES, ParallelDims,  # noqa: F401
                                          context_coords, coords_to_rank, expert_coords, rank_coords, rank_groups)
