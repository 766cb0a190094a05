"""``tern up``'s command line: its flags (each with a ``TERN_*`` variable default) and ``main``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx

from tern_stack.processes import StopRequested
from tern_stack.run_file import default_data_dir
from tern_stack.services import ServiceError
from tern_stack.up import DEFAULT_GATEWAY_PORT, READY_TIMEOUT_S, StackError, UpOptions, up


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="tern up",
        description="Start PostgreSQL, Redis, an engine and the gateway on this machine; Ctrl-C stops them.",
    )
    parser.add_argument("--model", help="a Hugging Face directory or GGUF file (default: the built-in model)")
    parser.add_argument(
        "--served-model-name",
        help="the model name in /v1/models and requests, as for `tern engine` (default: from the file)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="engine device (default: auto)")
    parser.add_argument(
        "--host",
        default=os.environ.get("TERN_GATEWAY_HOST", "127.0.0.1"),
        help="gateway listen address (default: TERN_GATEWAY_HOST or 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=os.environ.get("TERN_GATEWAY_PORT", str(DEFAULT_GATEWAY_PORT)),
        help="gateway port (default: TERN_GATEWAY_PORT or 8000)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        metavar="DIR",
        help="databases, secrets and logs (default: TERN_DATA_DIR or .tern)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT_S,
        dest="ready_timeout_s",
        metavar="SECONDS",
        help=f"give up if /readyz is not 200 by then (default: {READY_TIMEOUT_S:.0f})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = UpOptions(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        ready_timeout_s=args.ready_timeout_s,
    )
    try:
        return up(options)
    except StopRequested as stop:
        print(f"\n{stop}: stopped while starting", flush=True)
        return 130
    except (StackError, ServiceError, httpx.HTTPError) as error:
        print(f"\ntern up: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
