"""A Job: what one stage asks of an executor. Stages build them from config; executors render and run them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Job:
    stage: str                    # data_preparation | training | conversion | evaluation
    run_name: str
    results_dir: Path
    nodes: int
    nproc_per_node: int           # worker processes on each node (torchrun's --nproc_per_node, or 1)
    distributed: bool             # run the program under torchrun across `nodes`
    accelerator: str | None = None  # cpu | gpu | neuron: what the stage's config runs its workers on, if it says
    program: tuple[str, ...]      # argv after the Python interpreter, e.g. ('-m', 'runtime.train', '--config', F)
    time_limit: str
    dependency: str               # how this job waits for the previous one: afterok | afterany | singleton
    stage_config: dict[str, Any] = field(repr=False)  # the resolved stage subtree, written as config_path
    array_size: int | None = None     # Slurm array tasks; each gets --task-index I --num-tasks N
    array_parallel: int | None = None  # at most this many array tasks at once (%N)
    env: dict[str, str] = field(default_factory=dict)
    # Preemption on Slurm (docs/launcher.md): Slurm sends the job script SIGUSR1 this many seconds before
    # time_limit (None: no signal); the script passes it to the workers, which save and stop, and then requeues
    # the job while $SLURM_RESTART_COUNT < max_restarts. Both unset: the script handles no signals.
    preemption_signal_s: int | None = None
    max_restarts: int = 0
    # <stage>.fault_tolerance of a trainer stage (runtime/schema/training_config.FaultToleranceConfig), when enabled:
    # the node's watchdog times the workers, and on Slurm the script restarts a failed attempt, checks its nodes and
    # requeues without a bad one (docs/fault_tolerance.md). None: none of that.
    fault_tolerance: Any = None
    # run.elastic of a trainer stage: after a lost node with no spare, the script goes on with one node fewer (fewer
    # data-parallel replicas, the same global batch; docs/fault_tolerance.md).
    elastic: bool = False
    # Where this launch's stage config is written (launch.make_plan: <results_dir>/launches/<launch id>/): a name no
    # later launch writes, so a queued or running job reads what it was submitted with. None: the results directory
    # itself (a job rendered outside a launch, as the golden files are).
    config_dir: Path | None = None

    @property
    def config_path(self) -> Path:
        return (self.config_dir or self.results_dir) / f"{self.stage}_config.yaml"

    def in_launch(self, launch_id: str) -> "Job":
        """This job with its config under the launch's own directory, and its program reading it from there (and
        any other file the launch writes beside it: a torchtitan job's generated module)."""
        moved = dataclasses.replace(self, config_dir=self.results_dir / "launches" / launch_id)
        old, new = self.config_path.parent, moved.config_path.parent
        program = tuple(str(new / Path(arg).name) if Path(arg).parent == old and arg.endswith((".yaml", ".py"))
                        else arg for arg in self.program)
        return dataclasses.replace(moved, program=program)

    @property
    def log_dir(self) -> Path:
        return self.results_dir / "logs"

    @property
    def tasks(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def spare_nodes(self) -> int:
        """Nodes allocated beyond `nodes`, to take a lost node's place (fault_tolerance.spare_nodes)."""
        return self.fault_tolerance.spare_nodes if self.fault_tolerance else 0

    @property
    def allocated_nodes(self) -> int:
        return self.nodes + self.spare_nodes

    @property
    def peer_state_every(self) -> int:
        """Every how many steps the workers refresh their state's copies in the peer stores (0: no stores)."""
        return self.fault_tolerance.peer_state_every_n_steps if self.fault_tolerance else 0

    @property
    def moves_nodes(self) -> bool:
        """Whether a restart may run the training step on other nodes (a spare's) or fewer (elastic)."""
        return bool(self.fault_tolerance and (self.spare_nodes or self.elastic))

    @property
    def preemptible(self) -> bool:
        return bool(self.preemption_signal_s or self.max_restarts)

    @property
    def requeues(self) -> bool:
        """Whether the job may requeue itself (#SBATCH --requeue): after a signal, or without a bad node."""
        return bool(self.max_restarts or (self.fault_tolerance and self.fault_tolerance.requeues_on_failure))

    @property
    def watchdog_env(self) -> dict[str, str]:
        """The watchdog's timeouts, as runtime.torchrun reads them (runtime/fault_tolerance/watchdog.py)."""
        if not self.fault_tolerance:
            return {}
        from runtime.fault_tolerance.watchdog import Timeouts

        ft = self.fault_tolerance
        return Timeouts(ft.setup_timeout_s, ft.checkpoint_timeout_s, ft.step_timeout_s, ft.step_timeout_factor,
                        ft.step_timeout_floor_s).env()

    @property
    def shutdown_timeout_s(self) -> int:
        """How long torchrun waits for its signalled workers to save and exit before it kills them: the time the
        warning leaves before the limit, and never less than a minute."""
        return max(self.preemption_signal_s or 0, 60)
