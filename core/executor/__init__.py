"""The engine core's workers: the `Executor` contract every executor keeps and its error types
(`executor.py`), worker processes on this host and on others (`multiproc_executor.py`,
`worker_listener.py`), ranks placed by Ray (`ray_executor.py`, `ray_worker_actor.py`), and the
choice between them (`executor_factory.py`)."""
