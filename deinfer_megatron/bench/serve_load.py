"""Load against ``serve``: Poisson arrivals, mixed prompt and output lengths, and the same
requests as static ``generate`` batches, for the throughput / latency comparison of issue 11.

The server side streams every request (greedy) through the OpenAI completions API: TTFT is the
time from a request's send to its first text chunk, TPOT the time after that per further token,
end-to-end the time to its last chunk; throughput is the completion tokens the server reports
(``usage``) over the wall time from the first arrival to the last answer.

On a machine shared with other work the wall times of the two sides, run one after the other,
see different loads; the CPU seconds each side's model thread was given (the server's model
loop and HTTP threads, from its ``/metrics``; the static rank 0's thread) do not, so the report
also gives the throughput per CPU second of each side and their ratio.

The static side loads the model once in fresh ranks and runs the same prompts, in arrival order,
as batches of ``concurrency`` with the project's generation loop: every batch generates up to the
longest ``max_tokens`` of its rows (that is what a static batch does); each request counts its own
tokens. The measured batch times are then laid on the same arrivals (``static_report``): a batch
starts once its last request has arrived and the previous batch is done, and a request's TTFT and
end-to-end latency count from its own arrival, as the server's do.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.bench.serve_metrics import MetricsPoller
from deinfer_megatron.bench.serve_profile import StepProfileSpec, profile_served_steps, summarize
from deinfer_megatron.generation.context import GenerationContext
from deinfer_megatron.generation.loop import generate_tokens
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext, run_job
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan, latent_cache_layouts
from deinfer_megatron.specs.rank_config import RankConfig

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be has had it "
         "one not but also its after first new who they two her she been other when there all during into "
         "school time may years more most only over city some world would where later up such used many can "
         "state about national out known university united then made").split()


@dataclass(frozen=True)
class LoadSpec:
    """The request set: ``requests`` arrivals at ``rate`` per second (Poisson), at most
    ``concurrency`` in flight, prompt and output lengths uniform in their ranges; every prompt
    starts with the same ``system_words`` words (a shared system prompt, for the prefix cache)."""

    requests: int = 64
    rate: float = 4.0
    concurrency: int = 16
    prompt_words: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (16, 128)
    seed: int = 0
    system_words: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("--requests and --concurrency must be at least 1")
        if self.system_words < 0:
            raise ValueError(f"--system-words must be ≥ 0, got {self.system_words}")
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0 requests per second, got {self.rate}")
        for flag, (low, high) in (("--prompt-words", self.prompt_words), ("--output-tokens", self.output_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{flag} takes LOW:HIGH with 1 ≤ LOW ≤ HIGH, got {low}:{high}")


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int
    arrival_s: float  # after the start of the run


def make_requests(spec: LoadSpec) -> list[LoadRequest]:
    """The same request set for the same spec (seeded)."""
    rng = random.Random(spec.seed)
    shared = random.Random(f"system-{spec.seed}")
    system = "".join(shared.choice(WORDS) + " " for _ in range(spec.system_words))
    out, t = [], 0.0
    for _ in range(spec.requests):
        words = rng.randint(*spec.prompt_words)
        out.append(LoadRequest(system + " ".join(rng.choice(WORDS) for _ in range(words)),
                               rng.randint(*spec.output_tokens), t))
        t += rng.expovariate(spec.rate)
    return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p99": at(0.99), "mean": statistics.fmean(ordered)}


async def _one(client: Any, url: str, model: str, request: LoadRequest, headers: dict) -> dict[str, Any]:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0,
            "stream": True}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        return {"error": "no text"}
    return {"ttft": first - sent, "e2e": last - sent, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


async def _drive(url: str, model: str, requests: list[LoadRequest], concurrency: int, api_key: str | None
                 ) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def arrive(client: Any, request: LoadRequest) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        async with gate:
            try:
                return await _one(client, url, model, request, headers)
            except httpx.HTTPError as err:  # refused, reset, timed out: that request failed
                return {"error": f"{type(err).__name__}: {err}"}

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency)) as client, \
            httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as side:
        poller, stop = MetricsPoller(side, url, headers), asyncio.Event()
        polling = asyncio.create_task(poller.run(stop))
        results = await asyncio.gather(*(arrive(client, r) for r in requests))
        wall = time.perf_counter() - start
        stop.set()
        await polling
    return list(results), wall, poller.report()


def run_server_load(url: str, model: str, requests: list[LoadRequest], concurrency: int,
                    api_key: str | None = None) -> dict[str, Any]:
    """Replay ``requests`` against a running server; throughput and latency percentiles, and what
    the server's ``/metrics`` said about the run (``serve_metrics``)."""
    results, wall, observed = asyncio.run(_drive(url.rstrip("/"), model, requests, concurrency, api_key))
    done = [r for r in results if "error" not in r]
    if not done:
        raise RuntimeError(f"no request was answered by {url}: {results[0]['error']}; is the server running "
                           "and --served-model-name right?")
    tokens = sum(r["tokens"] for r in done)
    return {"completed": len(done), "errors": len(results) - len(done), "wall_s": wall,
            "refused_429": sum(1 for r in results if r.get("error") == 429),
            "completion_tokens": tokens, "throughput_tokens_per_s": tokens / wall,
            "ttft_s": percentiles([r["ttft"] for r in done]),
            "tpot_s": percentiles([r["tpot"] for r in done if r["tpot"] is not None]),
            "e2e_s": percentiles([r["e2e"] for r in done]), "metrics": observed}


@dataclass(frozen=True)
class StaticBatches:
    """The requests as static ``generate`` batches on TP×PP ranks (``runtime.job.JobSpec``): each
    batch prefilled together and decoded until its longest request is done."""

    model: Path
    parallel: Parallelism
    kv_cache: CacheKind
    batches: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]  # per batch: (prompt ids, max tokens)
    profile: StepProfileSpec | None = None  # then also profile a served step on these ranks
    dtype = DType.FLOAT32
    engine = Engine.MEGATRON
    verify = True

    @property
    def longest(self) -> int:
        """Tokens the longest sequence of any batch reaches."""
        return max(len(p) + m for batch in self.batches for p, m in batch)

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        if self.longest > arch.max_positions:
            raise ValueError(f"a request needs {self.longest} tokens, more than the model's context of "
                             f"{arch.max_positions}; lower --prompt-words or --output-tokens")

    def workload(self) -> Workload:
        return Workload(tp=self.parallel.tp, batch=max(map(len, self.batches)), context=self.longest,
                        latent_cache=self.kv_cache is CacheKind.LATENT)

    def footprint(self, arch: ModelArch) -> Footprint:
        rows = max(len(b) for b in self.batches)
        return Footprint(kv_tokens=rows * self.longest, kv_cache=self.kv_cache, prefill_rows=rows * self.longest,
                         context=self.longest, logit_rows=rows)

    def check_plan(self, plan: LayoutPlan) -> None:
        if self.kv_cache is CacheKind.LATENT and not plan.supports_latent_cache:
            raise ValueError(f"--kv-cache latent needs --layout {latent_cache_layouts()} (whole latents on every rank)")


def _static_on_rank(ctx: RankContext) -> dict[str, Any] | None:
    """Every batch in turn on this rank; each request's timings on global rank 0 (and, when asked,
    every rank's profile of a served step: ``serve_profile``)."""
    rows: list[dict[str, float]] = []
    for batch in ctx.spec.batches:
        prompts = [list(p) for p, _ in batch]
        longest = max(m for _, m in batch)
        context = GenerationContext(len(prompts), max(map(len, prompts)) + longest, kv_cache=ctx.spec.kv_cache)
        start, cpu = time.perf_counter(), time.thread_time()
        outputs, timing = generate_tokens(ctx.stage, prompts, max_new_tokens=longest, params=SamplingParams(),
                                          context=context)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        rows += [{"ttft": timing.prefill_s, "e2e": wall, "tokens": min(len(o.token_ids), m), "batch_s": wall,
                  "batch_cpu_s": cpu} for o, (_, m) in zip(outputs, batch)]
    profile = None
    if ctx.spec.profile is not None:
        mine = profile_served_steps(ctx.stage, ctx.spec.profile, ctx.spec.kv_cache)
        every = [pickle.loads(b) for b in comm.gather_bytes(pickle.dumps(mine), ctx.stage.device)]
        profile = summarize(every[: ctx.stage.groups.tp_size])  # the first stage's TP ranks
    return {"rows": rows, "profile": profile} if ctx.reports else None


def run_static_batches(model: Path, requests: list[LoadRequest], concurrency: int, *, tp: int = 1, pp: int = 1,
                       layout: Layout = Layout.DEINFER, kv_cache: CacheKind = CacheKind.FULL,
                       profile_chunk: int | None = None) -> dict[str, Any]:
    """The same prompts as static batches of ``concurrency`` in arrival order (one rank start);
    with ``profile_chunk``, also the profile of a served decode step of ``concurrency`` rows at
    the requests' mean prompt length, and of it with ``profile_chunk`` prompt tokens more."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    encoded = [(tuple(tokenizer(r.prompt, add_special_tokens=True)["input_ids"]), r.max_tokens) for r in requests]
    batches = tuple(tuple(encoded[i : i + concurrency]) for i in range(0, len(encoded), concurrency))
    profile = None
    if profile_chunk is not None:
        mean_prompt = round(statistics.fmean(len(p) for p, _ in encoded))
        profile = StepProfileSpec(rows=concurrency, context=mean_prompt, chunk=profile_chunk)
    spec = StaticBatches(Path(model), Parallelism(tp, pp, layout), CacheKind.parse(kv_cache), batches, profile)
    result = run_job(spec, _static_on_rank)
    report = static_report(requests, result["rows"], concurrency)
    if result["profile"] is not None:
        report["served_step_profile"] = result["profile"]
    return report


def static_report(requests: list[LoadRequest], rows: list[dict[str, float]], concurrency: int) -> dict[str, Any]:
    """Latency of static batching under the same arrivals: a batch starts when its last request
    has arrived and the previous batch is done; each request waits for its batch's start."""
    ttft, e2e, end, cpu = [], [], 0.0, 0.0
    for i in range(0, len(rows), concurrency):
        batch = list(zip(requests[i : i + concurrency], rows[i : i + concurrency]))
        start = max(end, max(r.arrival_s for r, _ in batch))
        end = start + batch[0][1]["batch_s"]
        cpu += batch[0][1].get("batch_cpu_s", 0.0)
        ttft += [start - r.arrival_s + row["ttft"] for r, row in batch]
        e2e += [end - r.arrival_s for r, _ in batch]
    tokens = sum(r["tokens"] for r in rows)
    return {"completed": len(rows), "wall_s": end, "completion_tokens": tokens,
            "throughput_tokens_per_s": tokens / end if end else 0.0, "cpu_s": cpu,
            "ttft_s": percentiles(ttft), "e2e_s": percentiles(e2e)}
