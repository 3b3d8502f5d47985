"""``deinfer-megatron loadgen``: replay a Poisson request set against ``serve``, and optionally
the same requests as static ``generate`` batches, and report throughput and latency."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.bench.serve_load import LoadSpec, make_requests, run_server_load, run_static_batches
from deinfer_megatron.cli.arguments import names, parsed_by
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.cli.serve_cmd import API_KEY_ENV
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.specs.layout import Layout


@dataclass(frozen=True)
class LoadgenConfig:
    url: str | None
    model_name: str | None
    spec: LoadSpec
    api_key: str | None = None
    static_model: Path | None = None
    tp: int = 1
    pp: int = 1
    layout: Layout = Layout.DEINFER
    kv_cache: CacheKind = CacheKind.FULL
    profile_chunk: int | None = None
    json: bool = False


def _range(flag: str):
    def parse(text: str) -> tuple[int, int]:
        try:
            low, high = (int(v) for v in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes LOW:HIGH, e.g. 16:128") from None
        return low, high
    return parse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadgen", help="Poisson load against `serve` (and the same requests as static batches)")
    p.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--served-model-name", dest="model_name", help="the model name the server serves")
    p.add_argument("--api-key", help=f"the server's key (or {API_KEY_ENV})")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=16, help="clients in flight; the static batch size")
    p.add_argument("--prompt-words", type=_range("--prompt-words"), default=(16, 256))
    p.add_argument("--output-tokens", type=_range("--output-tokens"), default=(16, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-words", type=int, default=0,
                   help="start every prompt with the same N words (a shared system prompt)")
    p.add_argument("--static-model", type=Path, help="also run the requests as static generate batches of this folder")
    p.add_argument("--tp", type=int, default=1, help="static batches: TP size")
    p.add_argument("--pp", type=int, default=1, help="static batches: PP size")
    p.add_argument("--layout", type=parsed_by(Layout.parse), choices=names(Layout), default=Layout.DEINFER)
    p.add_argument("--kv-cache", type=parsed_by(CacheKind.parse), choices=names(CacheKind), default=CacheKind.FULL)
    p.add_argument("--profile", dest="profile_chunk", type=int, nargs="?", const=256, metavar="CHUNK",
                   help="with --static-model: also profile a served decode step of --concurrency rows, and the "
                        "same step with CHUNK (default 256) prompt tokens more, on the static batches' ranks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(args: argparse.Namespace) -> LoadgenConfig:
    spec = LoadSpec(requests=args.requests, rate=args.rate, concurrency=args.concurrency,
                    prompt_words=args.prompt_words, output_tokens=args.output_tokens, seed=args.seed,
                    system_words=args.system_words)
    if args.url is None and args.static_model is None:
        raise ValueError("give --url (a running server) and/or --static-model (static batches)")
    if args.url is not None and not args.model_name:
        raise ValueError("--url needs --served-model-name (the name in the server's /v1/models)")
    if args.profile_chunk is not None and args.static_model is None:
        raise ValueError("--profile needs --static-model (the folder whose served step it profiles)")
    if args.profile_chunk is not None and args.profile_chunk < 1:
        raise ValueError(f"--profile CHUNK must be at least 1 prompt token, got {args.profile_chunk}")
    return LoadgenConfig(url=args.url, model_name=args.model_name, spec=spec,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         static_model=args.static_model, tp=args.tp, pp=args.pp, layout=args.layout,
                         kv_cache=args.kv_cache, profile_chunk=args.profile_chunk, json=args.json)


def main(cfg: LoadgenConfig) -> int:
    requests = make_requests(cfg.spec)
    report: dict = {"requests": len(requests), "rate": cfg.spec.rate, "concurrency": cfg.spec.concurrency,
                    "prompt_words": list(cfg.spec.prompt_words), "output_tokens": list(cfg.spec.output_tokens),
                    "system_words": cfg.spec.system_words}
    if cfg.url is not None:
        report["server"] = run_server_load(cfg.url, cfg.model_name, requests, cfg.spec.concurrency, cfg.api_key)
    if cfg.static_model is not None:
        report["static"] = run_static_batches(cfg.static_model, requests, cfg.spec.concurrency, tp=cfg.tp,
                                              pp=cfg.pp, layout=cfg.layout, kv_cache=cfg.kv_cache,
                                              profile_chunk=cfg.profile_chunk)
    if "server" in report and "static" in report:
        server, static = report["server"], report["static"]
        report["throughput_ratio"] = server["throughput_tokens_per_s"] / max(1e-9, static["throughput_tokens_per_s"])
        report["server_p99_ttft_below_static_p50_e2e"] = (
            server["ttft_s"]["p99"] is not None and server["ttft_s"]["p99"] < static["e2e_s"]["p50"])
        threads = server.get("metrics", {}).get("thread_cpu_s", {})
        server_cpu = sum(v or 0.0 for v in threads.values())
        if server_cpu > 0 and static["cpu_s"] > 0:  # the same work per CPU second given, whatever the load
            report["throughput_ratio_per_cpu_s"] = ((server["completion_tokens"] / server_cpu)
                                                    / (static["completion_tokens"] / static["cpu_s"]))
    if cfg.json:
        emit_json(report, indent=2)
    else:
        for side in ("server", "static"):
            if side in report:
                r = report[side]
                print(f"{side}: {r['completed']} requests, {r['throughput_tokens_per_s']:.1f} tokens/s, "
                      f"TTFT p50 {r['ttft_s']['p50']:.3f} s p99 {r['ttft_s']['p99']:.3f} s, "
                      f"end-to-end p50 {r['e2e_s']['p50']:.3f} s")
        observed = report.get("server", {}).get("metrics", {})
        if "steps" in observed:
            phases = observed["step_phase_s"]
            busy = max(1e-9, sum(v or 0.0 for v in phases.values()))
            print(f"server side: {observed['steps']:.0f} steps, at most {observed['peak_running_sequences']:.0f} "
                  f"sequences at once, prefix-cache hits {100 * observed.get('prefix_cache_hit_ratio', 0.0):.0f}%; "
                  "model loop: " + ", ".join(f"{p} {100 * (v or 0.0) / busy:.0f}%" for p, v in phases.items()))
        if "throughput_ratio" in report:
            print(f"server / static throughput: {report['throughput_ratio']:.2f}×"
                  + (f" ({report['throughput_ratio_per_cpu_s']:.2f}× per CPU second)"
                     if "throughput_ratio_per_cpu_s" in report else ""))
        for step, ranks in report.get("static", {}).get("served_step_profile", {}).items():
            for r in ranks:
                print(f"served {step} step, rank {r['tp_rank']}: {1e3 * r['step_s']:.1f} ms = GEMM "
                      f"{1e3 * r['gemm_s']:.1f} + attention {1e3 * r['attention_s']:.1f} + waiting for peers "
                      f"{1e3 * r['collective_wait_s']:.1f} + collectives {1e3 * r['collective_s']:.1f} + other "
                      f"{1e3 * r['other_s']:.1f}")
    return 0
