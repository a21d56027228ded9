"""The one place tpm2-pytss is imported: optional (the ``tpm`` extra), so a missing library
or missing system libtss2 becomes :class:`~identity.errors.TpmUnavailable` with its reason,
and ``import identity`` never needs it."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

from ..errors import TpmUnavailable


@functools.cache
def pytss() -> Any:
    """tpm2-pytss's names (ESAPI, the types, constants and utils) in one namespace."""
    # libtss2 logs every TPM error response to stderr (an absent NV index, which we probe
    # on purpose, included): errors reach the user through our messages instead.
    os.environ.setdefault("TSS2_LOG", "all+NONE")
    try:  # here, not at the top: the tpm extra is optional (module doc)
        import tpm2_pytss
        from tpm2_pytss import utils
    except ImportError as exc:
        raise TpmUnavailable(
            f"tpm2-pytss cannot be loaded ({exc}); install the tpm extra into this "
            "checkout: `make tpm`, or `pip install -e '.[tpm]'` (it builds against the "
            "system's tpm2-tss; Debian: libtss2-dev pkgconf)"
        ) from None
    names = {n: getattr(tpm2_pytss, n) for n in dir(tpm2_pytss) if not n.startswith("_")}
    return SimpleNamespace(**{**names, "utils": utils})


def unavailable_reason() -> str | None:
    """None when tpm2-pytss loads, else why not (for skips and ``blob tpm`` messages)."""
    try:
        pytss()
    except TpmUnavailable as exc:
        return str(exc)
    return None
