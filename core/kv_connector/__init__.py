"""The scheduler side of KV connectors: moving KV blocks between the pool and places beyond it
(host memory and disk: `OffloadingConnector`; another engine instance: `TcpConnector`, for
prefill/decode disaggregation), by block hash. The worker side is `worker/kv_connector/`."""
