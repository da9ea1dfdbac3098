"""Log lines that name their host: Hydra's ``job_logging`` formatter for the console and the per-rank
log file (conf/hydra/default.yaml). On a multi-node run the lines of ``train.log``/``rank<r>.log``
and of a console that several nodes print into say which machine wrote them."""

from __future__ import annotations

import logging
import socket

__all__ = ["HOST", "HostFormatter"]

HOST = socket.gethostname()


class HostFormatter(logging.Formatter):
    """``logging.Formatter`` with ``%(hostname)s``; built by ``logging.config.dictConfig`` (``format`` key)."""

    def __init__(self, format: str | None = None, datefmt: str | None = None) -> None:  # noqa: A002 - dictConfig's key
        super().__init__(fmt=format, datefmt=datefmt)

    def format(self, record: logging.LogRecord) -> str:
        record.hostname = HOST
        return super().format(record)
