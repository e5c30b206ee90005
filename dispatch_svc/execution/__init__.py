"""Running admitted jobs: the runner (start, end exactly once), takeover of jobs whose replica
stopped, the strategies (data-parallel inference and training, pipelines), outputs and combining."""
