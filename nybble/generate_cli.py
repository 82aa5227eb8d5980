"""``nybble generate "PROMPT"``: print a completion from the command line."""
from __future__ import annotations

import argparse
import os

from nybble.engine_args import add_engine_args, engine_config_from_args
from nybble.model_files import is_gguf


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description="Generate a completion for each PROMPT and print it.")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter in [0, 1]")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--chat", action="store_true",
                   help="send each PROMPT as one user message through the model's chat "
                        "template and print only the answer (for instruct models)")
    add_engine_args(p, lora=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate and print; returns the exit code (invalid input raises, and ``nybble``
    turns that into one error line and exit code 2).

    Raises:
        ValueError: the first PROMPT is an existing model folder or GGUF file (the model goes in
            ``--model``), or ``--chat`` on a model without a chat template.
    """
    first = args.prompts[0]
    kind = ("a model folder" if os.path.isfile(os.path.join(first, "config.json")) else
            "a GGUF model file" if is_gguf(first) and os.path.isfile(first) else None)
    if kind is not None:
        raise ValueError(f"the first PROMPT {first!r} is {kind}; pass it as --model "
                         f"{first} (nybble generate --model {first} \"PROMPT\")")
    engine_config_from_args(args).model_config.check_folders()  # NOTE: before torch: fast
    from nybble.runtime.worker.torch_threads import setup_threads
    from nybble.startup_gc import startup_gc_paused

    with startup_gc_paused():  # NOTE: imports and model load: nothing to collect
        args.threads = setup_threads(args.threads)  # NOTE: before torch is imported (next)
        from nybble.runtime.llm import LLM

        llm = LLM.from_engine_config(engine_config_from_args(args))
    from nybble.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed,
                            max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    prompts: list = list(args.prompts)
    if args.chat:   # NOTE: the template writes BOS itself: no special tokens added again
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                              add_special_tokens=False) for text in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        for sample in out.outputs:
            print(sample.text if args.chat else (out.prompt or "") + sample.text)
            if len(out.outputs) > 1 or len(outputs) > 1:
                print("-" * 40)
    return 0
