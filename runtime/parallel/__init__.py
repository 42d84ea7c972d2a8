# Parallelism applied to the plain models of runtime/models: the rank layout (dims), the process groups
# (topology), tensor/sequence-parallel layers, the sharding plan, data parallelism, and the sharded optimizer.
# The one owner of process groups.
from runtime.parallel.data_parallel import DataParallelConfig, apply_data_parallel
from runtime.parallel.dims import ParallelDims, coords_to_rank, rank_coords, rank_groups
from runtime.parallel.optimizer import AdamWConfig, ShardedAdamW
from runtime.parallel.parallelize import check_tensor_parallel, parallelize_model
from runtime.parallel.plan import ShardingPlan
from runtime.parallel.state import gather_full_state_dict
from runtime.parallel.topology import AxisGroup, Topology

__all__ = ["AdamWConfig", "AxisGroup", "DataParallelConfig", "ParallelDims", "ShardedAdamW", "ShardingPlan",
           "Topology", "apply_data_parallel", "check_tensor_parallel", "coords_to_rank", "gather_full_state_dict",
           "parallelize_model", "rank_coords", "rank_groups"]
