"""A clean console: every line once, no compiler noise, no advertisement, known warnings filtered.

The one place where third-party console output is filtered; each filter says why. Called by the
command line (``trainer/cli.py``) on every rank, after ``lightning`` is imported:

- one handler per line: Hydra's ``job_logging`` puts a console and a per-rank file handler on
  the root logger. Importing ``lightning`` adds its own console handler (and stops propagation)
  when the root has none yet, e.g. when it is imported before Hydra configured logging; either
  way a Lightning line would print twice or miss the rank's log file. ``single_handler`` drops
  Lightning's handlers and lets its records propagate to the root's.
- compiler lines: DeepSpeed probes its ops at start (async_io test-compiles ``-laio``) through
  setuptools' compiler classes, which log each gcc command at INFO (logger ``compilers``).
- advertisement: Lightning's "💡 Tip: ... litlogger ..." line at Trainer construction.
- ranks other than 0 print warnings and errors only: their info lines (mostly the same as rank
  0's, sometimes to the millisecond) stay in their ``rank<r>.log``.
- warnings (``KNOWN_WARNINGS``): third-party deprecations that the user cannot act on.
"""

from __future__ import annotations

import logging
import warnings

from dsdebug.errors import is_rank_zero

__all__ = ["KNOWN_WARNINGS", "LIGHTNING_LOGGERS", "filter_known_warnings", "quiet_console", "single_handler"]

LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")

# (category, message regex, module regex, why it is filtered)
KNOWN_WARNINGS: list[tuple[type[Warning], str, str, str]] = [
    (Warning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.",
     "Lightning 2.6.6 calls a torch pytree API that torch 2.13 deprecated; Lightning's business, harmless"),
    (Warning, r"torch\.distributed\.nn\.functional\.all_gather is deprecated", r"lightning\.",
     "Lightning 2.6.6's all_gather (the checks' cross-rank stats) uses a torch API that torch 2.13 deprecated; harmless"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     r"torch\.distributed\.",
     "DeepSpeed 0.19.8's ZeRO-3 gathers/reduce-scatters with torch APIs that torch 2.13 deprecated; DeepSpeed's "
     "business, harmless"),
]


class _DropAdvertisement(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip") or "litlogger" in message.lower())


def filter_known_warnings() -> None:
    for category, message, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def single_handler() -> None:
    """Lightning's records go to the root's handlers (console + rank log file) only, once."""
    root_has_handlers = bool(logging.getLogger().handlers)
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        if root_has_handlers:
            logger.propagate = True


def quiet_console() -> None:
    """Everything above, idempotent (a second call adds nothing)."""
    filter_known_warnings()
    single_handler()
    if not is_rank_zero():
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(max(handler.level, logging.WARNING))
    logging.getLogger("compilers").setLevel(logging.WARNING)  # gcc command lines of DeepSpeed's op probes
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropAdvertisement) for f in rank_zero.filters):
        rank_zero.addFilter(_DropAdvertisement())
