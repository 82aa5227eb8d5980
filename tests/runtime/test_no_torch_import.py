"""The Cython host runtime (allocator, scheduler, batch) must not pull in torch."""
from __future__ import annotations

import subprocess
import sys


def test_runtime_imports_leave_torch_out() -> None:
    code = ("import sys\n"
            "import nybble.runtime.block_allocator, nybble.runtime.scheduler\n"
            "import nybble.runtime.batch\n"
            "from nybble.runtime.scheduler import Scheduler\n"
            "Scheduler(8, 4, 2, 16, 32).schedule()\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
