"""The scheduler side of KV connectors: moving KV blocks between the pool and places beyond it
(host memory, disk), by block hash. The worker side is `worker/kv_connector/`."""
