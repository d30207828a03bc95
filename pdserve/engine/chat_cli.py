"""``pdserve chat "question"``: a one-shot offline chat, the answer streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from pdserve.config import ModelConfig, default_of


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``chat``."""
    p = subparsers.add_parser(
        "chat", help="ask the model one question offline (default: embedded SmolLM2)"
    )
    p.add_argument("question", help="the user message")
    p.add_argument(
        "--model",
        default=default_of(ModelConfig, "model"),
        help="HF folder, .gguf file, random:<preset> or the embedded id (default %(default)s)",
    )
    p.add_argument("--system", default=None, help="system message; unset: none")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of the answer")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top_p")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; unset: unseeded")
    p.add_argument(
        "--dtype",
        default=default_of(ModelConfig, "dtype"),
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
    )
    p.add_argument(
        "--device", default=default_of(ModelConfig, "device"), help="auto, cpu, cuda or cuda:N"
    )
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    """Stream the answer's text deltas as the engine produces them; 2 on bad arguments."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_running_requests=1)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.question})
        core = llm.engine
        core.add_request("chat", llm.chat_token_ids(messages), params)
    except ValueError as exc:
        print(f"pdserve chat: {exc}", file=sys.stderr)
        return 2
    while core.has_unfinished_requests():
        for out in core.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
