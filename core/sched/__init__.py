"""Scheduling: the `Scheduler` (continuous batching, chunked prefill, preemption), its
validated `SchedulerConfig`, the waiting queues of each policy, and the stop checks applied to
sampled tokens."""
