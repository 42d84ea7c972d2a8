"""A single training process that commits a checkpoint at step 1 and then starts writing step 2 (a model large
enough that the write takes a while); the crash test kills it with SIGKILL in the middle of that write."""
import sys

import torch

from runtime.checkpoint import Checkpointer
from runtime.device import init_device
from runtime.models import ModelConfig, build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model


def main(directory: str) -> None:
    device = init_device("cpu")
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    cfg = ModelConfig(architecture="gpt", vocab_size=4096, hidden_size=512, num_layers=8, num_attention_heads=8,
                      ffn_hidden_size=2048, max_position_embeddings=64)
    model = parallelize_model(build_model(cfg), topo, sequence_parallel=False, data_parallel=DataParallelConfig())
    optimizer = ShardedAdamW(model, {"lr": 1e-3})
    ckpt = Checkpointer(directory, rank=0, world_size=1, token="0", async_save=False)
    ckpt.save(1, model, optimizer, topo, extra={"step": 1}, config=None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # step 2's weights differ from step 1's
    print("committed step 1", flush=True)
    while True:  # write step 2 again and again until killed
        ckpt.save(2, model, optimizer, topo, extra={"step": 2}, config=None)
        ckpt.storage.delete_prefix("step_00000002.0")
        device.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
