"""Cluster validation: node health checks and collective bandwidth tests that name bad nodes.

    nxdt-launch cluster-validate                                   # every idle node of the partition
    nxdt-launch cluster-validate cluster.nodelist=[node1,node2] cluster_validation.devices=32
    python -m csp_tools.cluster_validate --config cluster_validation_config.yaml   # what each node runs

Parts (each readable on its own):
    config.py      the resolved `cluster_validation` YAML as typed dataclasses (torch-free: the launcher uses it)
    bandwidth.py   busbw factors, size sweeps and the nccl-tests column layout (torch-free)
    parsers.py     neuron-ls -j, fi_info, nvidia-smi and nccom-test output (torch-free)
    health.py      per-node checks, and the cross-node comparisons (versions, clock skew)
    sweep.py       PURE pair sweep and bisection over a measurement callback: which nodes are bad
    confirm.py     PURE: a suspect is named only when its deficit repeats (also the training job's node checks)
    measure.py     the timed torch.distributed loop and its correctness check
    worker.py      one worker process per device; runs measure.py for the agent
    node.py        the agent every node runs; node 0 also hosts the control store and coordinates
    coordinator.py the phases: health, within each node, pairs, all nodes; writes the report
    report.py      cluster_validation.json, rich tables, the cluster.exclude override (torch-free)
"""
