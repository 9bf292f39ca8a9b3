"""Where runs go beyond this process: Ray job submission (``ray_jobs``) and KubeRay manifests
(``manifests``). Ray is imported only where a run goes to a Ray cluster."""

#: the environment variable that carries a submitted run (config, Hydra context, run dir) to its Ray job.
RAY_JOB_PAYLOAD = "RLEXP_RAY_JOB"
