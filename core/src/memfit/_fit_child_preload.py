"""Imported once by the fork server that starts ``memfit fit``'s measuring children (see
:mod:`memfit.isolation`): torch and memfit are loaded there, so a child, forked from it, starts without
importing them again.

Adapters (and with them diffusers) are *not* imported here: diffusers asks ``torch.cuda.is_available()`` at
import, which initialises the CUDA driver, and a process forked after that cannot use CUDA. Nothing imported
here touches CUDA (``core/tests/test_fit_failures.py`` checks it).
"""

import memfit.isolation  # noqa: F401
import memfit.job  # noqa: F401
