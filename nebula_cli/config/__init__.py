"""The spec and the typed plan.

The spec (launching machine only, pydantic): `spec` (the job spec's models; every default lives
here), `sections`, `fields`, `specfile` (bounded reading of untrusted files), `yaml_positions`
(file:line:col for every problem), `pipeline` (pipeline layouts); `jobplan` (`build_plan`: spec
-> a frozen `JobPlan`).

The plan's parts (standard library only: host processes load them): `parts` (`AgentConfig`,
`SyncConfig`), `relay_config` (`RelayConfig`), `strict` (strict JSON loading and 0600 writing).
"""
