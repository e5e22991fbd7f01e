"""The engine's tests, by subject: `core/`, `worker/`, `kernels/`, `frontend/`, `proto/` (each
package's units, in process), `e2e/` (real engine processes, servers and clusters),
`benchmarks/` (the benchmarks cannot rot), `repo/` (the repository itself: import rules, docs,
the installed wheel); `helpers/` holds what several of them share."""
