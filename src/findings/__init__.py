"""The one channel every check reports through (see channel.py)."""

from dsdebug.findings.channel import (SEVERITIES, Finding, FindingsChannel, auto_configure, configure_channel,
                                      get_channel, needs_auto)

__all__ = ["SEVERITIES", "Finding", "FindingsChannel", "auto_configure", "configure_channel", "get_channel",
           "needs_auto"]
