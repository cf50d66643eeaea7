"""`triton-pd`: the project's command line (generate, serve, repository, key, bench, bundle, perf-analyzer)."""

from __future__ import annotations

import argparse
import json
import sys

from .common.core.request import IMAGE_PLACEHOLDER, SamplingParams


class CLIError(Exception):
    """An error to print as one line, without a traceback."""


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (vLLM semantics)")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 is off (default)")
    g.add_argument("--seed", type=int, default=None, help="seed; the same seed gives the same tokens")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS or a stop id may end the answer")
    g.add_argument("--ignore-eos", action="store_true", help="EOS is an ordinary token and does not stop")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; server only)")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        min_tokens=a.min_tokens,
        ignore_eos=a.ignore_eos,
        stop=a.stop,
    ).validate()


def cmd_generate(a: argparse.Namespace) -> int:
    params = sampling_from_args(a)
    if a.offline:
        result = generate_offline(a, params)
    else:
        from .client import ClientError, generate_remote

        try:
            images = [_read_image(path) for path in a.image]
            result = generate_remote(a.url, a.prompt, params, chat=a.chat, protocol=a.protocol, echo=not a.json,
                                     images=images)  # fmt: skip
        except ClientError as e:
            raise CLIError(f"server: {e}") from None
    if a.json:
        print(json.dumps(result, ensure_ascii=False))
    elif a.offline:
        print(result["text"])
    return 0


def generate_offline(a: argparse.Namespace, params: SamplingParams) -> dict:
    from .common.engine.engine import Engine
    from .common.model import loader

    loader.resolve(a.model)  # fail fast on a bad model spec, before loading anything
    engine = Engine(a.model, dtype=a.dtype, device=a.device, kv_tokens=a.kv_tokens, deterministic=a.deterministic,
                    quantization=a.quantization, tp=a.tp)  # fmt: skip
    try:
        return _generate_with(engine, a, params)
    finally:
        engine.close()


def _generate_with(engine, a: argparse.Namespace, params: SamplingParams) -> dict:
    tok = engine.tokenizer
    images = [_read_image(path) for path in a.image]
    if images:
        from .common.core.request import ParamError
        from .common.model.multimodal import prompt_ids

        if engine.runner.vision is None:
            raise CLIError(f"--image: the model {a.model} takes no images: {engine.runner.vision_missing}")
        try:
            ids = prompt_ids(tok, engine.runner.vision.vc, a.prompt, len(images), a.chat)
            out = engine.generate([ids], params, images=[images])[0]
        except ParamError as e:
            raise CLIError(str(e)) from None
        return {"output_ids": out.output_ids, "text": out.text, "finish_reason": out.finish_reason}
    ids = tok.encode_chat(a.prompt) if a.chat else tok.encode(a.prompt)
    out = engine.generate([ids], params)[0]
    return {"output_ids": out.output_ids, "text": out.text, "finish_reason": out.finish_reason}


def _read_image(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CLIError(f"--image {path}: {e.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triton-pd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one answer, offline or from a running server")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help=f"Qwen3.5 checkpoints: a PNG or JPEG image (repeatable), one per {IMAGE_PLACEHOLDER} in the prompt, "
        "in order; with --chat and none in the prompt, the images go before its text",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"output_ids", "text", "finish_reason"} instead of the text',
    )
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--offline", action="store_true", help="run the engine in this process")
    where.add_argument("--url", help="HOST:PORT of a running server (gRPC port, or HTTP with --protocol http)")
    g.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="with --url (default grpc)")
    g.add_argument(
        "--model",
        default="smollm2",
        help="offline: smollm2 (default), a Hugging Face folder, a .gguf file, or random:<shape>",
    )
    g.add_argument("--dtype", default="float32", help="offline: float32 (default), bfloat16 or float16")
    g.add_argument("--device", default=None, help="offline: cpu or cuda (default: cuda when available)")
    g.add_argument("--kv-tokens", type=int, default=16384, help="offline: KV pool size in tokens (default 16384)")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="offline, GPU: batch-invariant kernels (serve's --deterministic; dense models)",
    )
    g.add_argument(
        "--quantization",
        choices=["", "fp8"],
        default="",
        help="offline: fp8 converts a 16-bit checkpoint's projections to fine-grained FP8 at load (serve's "
        "--quantization)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="offline, CPU: tensor parallelism over this many processes (default 1; the model's head counts and "
        "widths must divide by it)",
    )
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    from . import bench, bundle, perf_analyzer, repository, serve

    for mod in (serve, repository, bench, bundle, perf_analyzer):
        mod.register(sub)
    serve.register_key(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .common.core.request import ParamError
    from .common.engine.engine import EngineError
    from .common.engine.tp_ranks import RankError
    from .common.model.loader import ModelError
    from .common.model.tensor_parallel import TPError
    from .common.model.tokenizer import TemplateError

    try:
        return args.func(args)
    except (CLIError, ModelError, ParamError, EngineError, TemplateError, TPError, RankError) as e:
        print(f"triton-pd: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
