"""``task=plan``: whether the composed run fits its cluster, per GPU, before anyone pays for GPUs.

Reads the config and the model's config only (no weights); prints how the run would launch, the memory
table, the verdict with what would make it fit, and GPU-hours and cost when ``cluster.price_per_hour``
is set.
"""

from omegaconf import DictConfig

from rlexp.planning import estimate, render, run_shape
from rlexp.runtime import cluster_choice


def plan(cfg: DictConfig) -> bool:
    """Prints the plan; returns whether the shape fits."""
    memory = estimate(run_shape(cfg, cluster_choice()))
    print(launch_line(cfg.cluster), flush=True)
    print(render(memory, cfg.cluster.price_per_hour, cfg.plan.step_time_s, cfg.total_steps), flush=True)
    return memory.fits


def launch_line(cluster) -> str:
    """How the processes start, and where nodes share files."""
    per_node = max(1, cluster.gpus_per_node)
    text = f"launch: {cluster.launcher.value}, {cluster.nodes} node(s) x {per_node} process(es)"
    if cluster.head is not None:
        text += f", Ray head {cluster.head}"
    if cluster.nodes > 1:
        text += f"; adapters and checkpoints on shared storage {cluster.shared_storage or '(none set: cluster.shared_storage is needed)'}"
    return text
