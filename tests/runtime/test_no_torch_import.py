"""The Cython host runtime (allocator, scheduler, batch) and its plain-Python reference must
not pull in torch."""
from __future__ import annotations

import subprocess
import sys


def test_runtime_imports_leave_torch_out() -> None:
    code = ("import sys\n"
            "import nybble.runtime.scheduler.block_allocator, nybble.runtime.scheduler.scheduler\n"
            "import nybble.runtime.scheduler.batch, nybble.runtime.scheduler.seq_table\n"
            "from nybble.runtime.scheduler.scheduler import Scheduler\n"
            "from nybble.runtime.scheduler.sequence import FinishReason\n"
            "from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler\n"
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


# NOTE: torch covers torch.distributed, transformers covers transformers.modeling_utils (the
# model-loading machinery AutoTokenizer pulls in); sympy comes with either; xgrammar and
# jsonschema are imported only by requests that use them (response_format, structured output)
API_FORBIDDEN = ("torch", "transformers", "sympy", "xgrammar", "jsonschema")


def test_api_process_modules_leave_torch_out() -> None:
    # Everything `nybble serve`'s HTTP process imports and runs before and while serving:
    # the CLI, the app, the gate on a real prompt and chat, the output side on core outputs.
    code = ("import sys\n"
            "from nybble.cli import build_parser\n"
            "args = build_parser(['serve']).parse_args(['serve'])\n"
            "from nybble.engine_args import engine_config_from_args\n"
            "import nybble.server.launch, nybble.server.app, nybble.runtime.frontend.async_engine\n"
            "from nybble.config import DEFAULT_MODEL\n"
            "from nybble.tokenizer.tokenizer import Tokenizer\n"
            "from nybble.runtime.frontend.input_processor import InputProcessor, RequestLimits\n"
            "from nybble.runtime.messages import EngineCoreOutputs\n"
            "from nybble.runtime.frontend.output_processor import OutputProcessor\n"
            "from nybble import SamplingParams\n"
            "engine_config_from_args(args)\n"
            "tok = Tokenizer.from_folder(DEFAULT_MODEL)\n"
            "gate = InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2, 1))\n"
            "chat = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])\n"
            "req = gate.process('r', chat, SamplingParams(max_tokens=2, stop=['x']))\n"
            "out = OutputProcessor(tok)\n"
            "out.add_request(req, chat)\n"
            "(o,), _ = out.process_outputs(EngineCoreOutputs(['r'], [0], [403], [2]))\n"
            "assert o.finished and o.outputs[0].text == ' Once', o\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {API_FORBIDDEN!r})\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
