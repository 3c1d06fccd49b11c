"""``python3 benchmarks/tools/run_nox.py -s gpu``: nox on a GPU machine that does not have it installed.

The machine's image has torch but not nox. nox and its dependencies travel as wheels (``device_wheels.sh`` here puts
them in ``.whl/nox/``) and ``device_env.sh`` installs them apart, in ``$MEMFIT_NOX_SITE``. That folder goes *after*
the machine's own packages on the path, so a package the image already has (``packaging``, ``attrs``…) is the
image's version, the one its torch and transformers were installed with.
"""

from __future__ import annotations

import os
import runpy
import sys

site = os.environ.get("MEMFIT_NOX_SITE")
if site and site not in sys.path:
    sys.path.append(site)
try:
    import nox  # noqa: F401
except ImportError:
    sys.exit(
        "nox is not installed on this machine: here, run `bash benchmarks/tools/device_wheels.sh` (nox and "
        "its dependencies into .whl/nox/) and carry .whl; device_env.sh installs them into $MEMFIT_NOX_SITE"
    )
runpy.run_module("nox", run_name="__main__", alter_sys=True)
