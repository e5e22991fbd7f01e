"""The GPU kit: `python -m benchmarks.gpu` (the `check` module) runs every GPU check in one
command on a machine lent for minutes; its steps are `engine_check`, `sanitize_cases`,
`kv_connector_check` and `spec_decode_check`."""
