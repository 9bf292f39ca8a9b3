"""Recipes: one module per task, each importing components and never imported by them.

``rlexp task=<name>`` runs ``TASKS[name]`` with the composed config; modules are imported only when
chosen. Training picks its recipe by ``algorithm.name``.
"""

#: task name -> "module:function" run with the composed config.
TASKS = {
    "train": "rlexp.tasks.train:train",
    "eval": "rlexp.tasks.eval:evaluate",
    "plan": "rlexp.tasks.plan:plan",
    "report": "rlexp.tasks.report:report",
    "export": "rlexp.tasks.export:export",
    "manifest": "rlexp.tasks.manifest:manifest",
}
