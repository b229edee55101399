"""`scheduler: kubernetes` (issue 44, first part): the spec's `kubernetes:` section (`spec`).
Not yet registered in `schedulers/registry.py`: the scheduler, manifests and allocator follow."""
