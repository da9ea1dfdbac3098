"""Processes: which launcher started us, our own launcher, liveness and heartbeats, one run dir per job, sweeps (submitit), per-rank log files."""

__all__ = []
