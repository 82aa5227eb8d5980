"""The Cython host runtime (allocator, scheduler, batch) and its plain-Python reference must
not pull in torch."""
from __future__ import annotations

import subprocess
import sys


def test_runtime_imports_leave_torch_out() -> None:
    code = ("import sys\n"
            "import nybble.runtime.block_allocator, nybble.runtime.scheduler\n"
            "import nybble.runtime.batch, nybble.runtime.seq_table\n"
            "from nybble.runtime.scheduler import Scheduler\n"
            "from nybble.runtime.sequence import FinishReason\n"
            "from nybble.runtime.reference_scheduler import ReferenceScheduler\n"
            "for impl in (Scheduler, ReferenceScheduler):\n"
            "    s = impl(8, 4, 2, 16, 32, enable_prefix_caching=True)\n"
            "    s.add(0, [1, 2, 3, 4, 5], 2)\n"
            "    b = s.schedule()\n"
            "    assert s.update(b, [9])[2].tolist() == [FinishReason.NONE]\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
