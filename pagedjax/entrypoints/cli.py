"""The ``pagedjax`` command (vLLM's CLI shape).

    pagedjax serve MODEL [server flags]      the OpenAI-compatible server
    pagedjax bench serve [benchmark flags]   vLLM's serving benchmark against a server
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pagedjax", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    from pagedjax.entrypoints.openai import cli_args

    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible server", allow_abbrev=False
    )
    cli_args.add_engine_args(serve, model_positional=True)
    cli_args.add_server_args(serve)
    cli_args.add_vllm_refusals(serve)

    bench = sub.add_parser("bench", help="benchmarks", allow_abbrev=False)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedjax.entrypoints import bench_serve

    bench_serve.add_args(
        bench_sub.add_parser("serve", help="vLLM's serving benchmark", allow_abbrev=False)
    )

    args = parser.parse_args(argv)
    if args.command == "serve":
        from pagedjax.entrypoints.openai.api_server import run_server

        run_server(args)
    elif args.command == "bench":
        bench_serve.main(args)


if __name__ == "__main__":
    main()
