"""The spec and the typed plan: `spec` (the YAML job spec, validated; every default lives
here), `yaml_positions` (file:line:col for every problem), `pipeline` (pipeline layouts),
`jobplan` (spec -> the processes to start). Pure data, no I/O beyond reading the spec."""
