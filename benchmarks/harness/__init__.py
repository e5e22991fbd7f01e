"""What every benchmark shares: workloads and result files (`common`), process and thread CPU
sampling (`proc_stats`), closed-loop clients (`closed_loop`), engine arms in their own process
(`engine_arm`), peers' processes (`peer_process`), and the benchmarks page written from
`benchmarks/results/` (`plot_results`)."""
