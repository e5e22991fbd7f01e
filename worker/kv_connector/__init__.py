"""The worker side of KV connectors: the bytes of KV blocks kept beyond the device's pool (host
memory, disk) or moved to and from another engine instance (a TCP block server and pulls),
copied in and out as the scheduler side's metadata says. The scheduler side is
`core/kv_connector/`."""
