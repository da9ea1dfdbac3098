"""Turning a run directory into something a person reads: history, rules, report."""

__all__ = []
