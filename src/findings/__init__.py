"""The one channel every check reports through (see channel.py)."""

from dsdebug.findings.channel import SEVERITIES, Finding, FindingsChannel, configure_channel, get_channel

__all__ = ["SEVERITIES", "Finding", "FindingsChannel", "configure_channel", "get_channel"]
