"""Before launch: whether a run's shape fits its GPUs, what it costs, and what would make it fit.

``task=plan`` prints ``render(plan)``; training calls ``check_fit`` before it loads anything.
"""

from rlexp.planning.memory import GB, MemoryPlan, RunShape, estimate, run_shape, suggestions, visible_gpu_gb
from rlexp.planning.report import check_fit, render

__all__ = ["GB", "MemoryPlan", "RunShape", "check_fit", "estimate", "render", "run_shape", "suggestions", "visible_gpu_gb"]
