"""`scheduler: kubernetes` (issue 44, first parts): the spec's `kubernetes:` section (`spec`) and
the objects a cluster is made of (`manifests`: an Indexed Job, a headless Service, a Secret, the
relay's Service). Not yet registered in `schedulers/registry.py`: the scheduler and the
allocator that creates, watches and deletes the objects follow."""
