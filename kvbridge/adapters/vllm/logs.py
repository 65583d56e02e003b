"""kvbridge's log lines under vLLM's logging set-up, in every process vLLM starts.

``plugin.register`` calls ``configure_logging``: vLLM runs its general plugins in every process,
before or after it configures its own ``vllm`` logger.
"""

from __future__ import annotations

import logging
import os

#: The name of the handler ``configure_logging`` adds (and replaces when called again).
_HANDLER_NAME = "kvbridge"


class _ToVllmLogger(logging.Handler):
    """Hands kvbridge's records to vLLM's ``vllm`` logger: they come out through vLLM's own
    handlers, format and stream (a JSON formatter or ``VLLM_LOGGING_CONFIG_PATH`` included).

    vLLM configures that logger in each process at its own time, possibly after the plugins
    load, so where it goes is looked up per record; where vLLM configured nothing
    (``VLLM_CONFIGURE_LOGGING=0``), records go to the root logger, as without this handler.
    """

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        (vllm_logger if vllm_logger.handlers else logging.getLogger()).handle(record)


def configure_logging() -> None:
    """Make kvbridge's log lines appear under vLLM's logging setup, in every process.

    vLLM configures only its own ``vllm`` logger, so without this kvbridge's lines below
    WARNING would go nowhere and the rest would come out bare on stderr. By default they go
    through vLLM's handlers at vLLM's level (``VLLM_LOGGING_LEVEL``, INFO unless set).
    ``KVBRIDGE_LOG_LEVEL`` (e.g. ``DEBUG``) instead gives them a handler of their own at that
    level, with millisecond timestamps and the process id.
    """
    logger = logging.getLogger("kvbridge")
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    level = os.environ.get("KVBRIDGE_LOG_LEVEL", "").strip().upper()
    handler: logging.Handler
    if level:
        handler = logging.StreamHandler()
        fmt = "%(asctime)s.%(msecs)03d %(process)d %(name)s %(levelname)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    else:
        handler = _ToVllmLogger()
        level = os.environ.get("VLLM_LOGGING_LEVEL", "").strip().upper() or "INFO"
    handler.set_name(_HANDLER_NAME)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(level)
