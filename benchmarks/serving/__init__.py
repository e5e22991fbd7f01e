"""Online serving: `python -m benchmarks.serving [--quick]` (a Poisson load against core-serve,
and vLLM's own client against both servers), where its time goes (`profile`), and data
parallelism (`data_parallel`)."""
