"""Keeps pytest out of the template itself (its tests import ``memfit_template``, which is never installed).

The root ``testpaths`` includes ``adapters``. In a copy (``adapters/<family>``) this file does nothing, so
forgetting to delete it cannot hide your tests; delete it anyway.
"""

from pathlib import Path

collect_ignore_glob = ["*"] if Path(__file__).resolve().parent.name == "_template" else []
