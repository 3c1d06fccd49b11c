"""``import memfit`` stays cheap: FSDP (over a second to import) is loaded only once sharding is in use."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in a fresh interpreter: the test process has long imported everything.
PROBE = """
import json, sys
import torch
with_torch = set(sys.modules)
import memfit
added = set(sys.modules) - with_torch
_fsdp_module_class = getattr(sys.modules["memfit.distributed"], "_fsdp_module_class", lambda: None)
before = _fsdp_module_class()
from torch.distributed.fsdp import FSDPModule  # what a user's fully_shard brings in
print(json.dumps({
    "added": sorted(added),
    "class_before": before is None,
    "class_after": _fsdp_module_class() is FSDPModule,
}))
"""


def test_import_memfit_does_not_import_torch_distributed():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # `import torch` itself loads the base `torch.distributed` package; memfit must add none of it.
    assert [m for m in found["added"] if m.startswith("torch.distributed")] == []
    # FSDP's module class is looked up, never imported: absent before the user imports FSDP, found after.
    assert found["class_before"] and found["class_after"]


DISCOVERY = """
import json, sys
from memfit.adapters.discovery import available_adapters
names = sorted(available_adapters())
print(json.dumps({"adapters": names, "heavy": [m for m in ("diffusers", "transformers", "peft") if m in sys.modules]}))
"""


def test_finding_the_installed_adapters_imports_no_model_library():
    """``memfit fit`` and ``memfit list`` look every adapter up before validating their flags: an adapter declares
    its model classes by name and imports diffusers when it first builds one (a flag error stays one line, with
    none of the warnings a model library may print as it loads)."""
    out = subprocess.run([sys.executable, "-c", DISCOVERY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert "flux" in found["adapters"] and "mageflow" in found["adapters"]
    assert found["heavy"] == []
