"""Import ``transformers`` and ``mindone.transformers`` without their import-time noise.

Imported here without PyTorch, transformers 4.57 logs "None of PyTorch, TensorFlow >= 2.0, or
Flax have been found" (twice), mindone's image-processor table raises a ``FutureWarning`` about
an argument it passes itself, and transformers' docstring helper ``print``\\ s "Config not
found for parakeet" three times; loading a Qwen2-VL processor, mindone warns that it falls back
to transformers' tokenizer class: none of it is about the user's code. :func:`quiet_imports`
drops exactly those, only while the library imports them: the user's own logging, warnings and
prints are left as they are, and any other line printed meanwhile is printed again after.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator

#: Beginnings of the log messages dropped (logger "transformers", at import).
_LOG_NOISE = ("None of PyTorch, TensorFlow >= 2.0, or Flax have been found",)
#: Beginnings of the printed lines dropped.
_PRINT_NOISE = ("🚨 Config not found for ",)
#: The loggers the log noise comes from.
_LOGGERS = ("transformers", "mindone", "mindone.transformers", "mindone.transformers.processing_utils")


#: mindone's processor loader warns that it takes transformers' class for any class it has no
#: port of; for a tokenizer (pure Python, no PyTorch backend) that is what it should do.
_TOKENIZER_FALLBACK = re.compile(r"Falling back to 🤗 Transformers `\w*Tokenizer(Fast)?`")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith(_LOG_NOISE) or _TOKENIZER_FALLBACK.match(message))


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """While inside: the known import-time messages of transformers and mindone are dropped."""
    drop = _DropNoise()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    printed = io.StringIO()
    for logger in loggers:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.filterwarnings("ignore", message="The image_processor_class argument is deprecated")
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)
        kept = [line for line in printed.getvalue().splitlines(True) if not line.startswith(_PRINT_NOISE)]
        sys.stdout.write("".join(kept))
