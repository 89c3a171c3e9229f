"""The run directory: a directory of steps, one checkpoint each.

`run.Run` is one run as the job that holds it sees it (lease, committed steps, keep
policy, lineage); `checkpoints` is the API without a manager; `steps` lists and reads
steps; `lease`, `retention`, `lineage` and `guards` are the parts a run is made of.
"""
