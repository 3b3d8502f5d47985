"""The ``serve`` job: every rank loads its stage and runs the step loop; rank 0 also serves HTTP.

Rank 0's main thread runs the scheduler and the model loop; uvicorn runs in a thread beside it.
Each step rank 0 sends the step's plan to the other ranks (``step.exchange_plan``), and every
rank runs it; when nothing is to be done an empty plan goes out every second, so that the other
ranks, waiting in the broadcast, never reach its timeout.

KV memory is one pool of blocks per rank (``layers.paged_cache``): as many blocks of
``--block-size`` tokens as ``--kv-budget-gb`` holds, else enough for ``--max-batch`` sequences of
``--max-seq-len`` tokens (the smallest count over the ranks, so every rank agrees). Rank 0's
scheduler hands the blocks out (``blocks.BlockManager``) and shares prompt prefixes.

Lifetime: SIGTERM makes rank 0 refuse new and queued requests, finish the running ones, stop
every rank and return (exit status 0); the other ranks ignore it and stop with rank 0. If the
loop breaks (a peer died and a collective failed), ``/health`` answers 503, every in-flight
request ends with an error, and the job fails: the command exits non-zero. Ranks this command
starts itself are stopped by their launcher (``launch.local``) within a second of a rank's death.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from deinfer_megatron.arch.model import ModelArch, load_arch
from deinfer_megatron.generation.job import eos_ids, kv_bytes_per_token
from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.layers.paged_cache import PagedContext
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext, check_job, prepare, run_prepared
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.serving.blocks import DEFAULT_BLOCK_SIZE, BlockManager, pool_blocks
from deinfer_megatron.serving.http import ServerState, build_app
from deinfer_megatron.serving.metrics import ServerMetrics
from deinfer_megatron.serving.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
from deinfer_megatron.serving.stats import PHASES, StepStats
from deinfer_megatron.serving.step import StepPlan, StepRunner, exchange_plan
from deinfer_megatron.specs.layout import Layout, LayoutPlan, latent_cache_layouts
from deinfer_megatron.specs.rank_config import RankConfig

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class ServeJob:
    """A server: the model, where its ranks run, its KV memory and its HTTP face."""

    model: Path
    parallel: Parallelism = field(default_factory=Parallelism)
    cache: CacheOptions = field(default_factory=CacheOptions)
    engine: Engine = Engine.MEGATRON
    dtype: DType = DType.FLOAT32
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16  # sequences running at once
    max_queue: int = 64  # requests waiting for room before 429
    max_seq_len: int | None = None  # tokens per sequence; None: the model's context, at most 2048
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block
    prefix_caching: bool = True
    served_model_name: str | None = None  # None: the folder's name
    api_key: str | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per step, over all prefilling sequences
    default_max_tokens: int = 16  # OpenAI's default for completions
    verify: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine.parse(self.engine))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if self.parallel.layout.is_auto:  # one plan would have to hold for every batch the scheduler forms
            raise ValueError(f"serve takes a fixed --layout ({', '.join(l.value for l in Layout)}), not auto")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def tokens_per_sequence(self, arch: ModelArch) -> int:
        """``--max-seq-len``, else the model's context up to 2048 tokens."""
        return self.max_seq_len or min(arch.max_positions, 2048)

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        """What can be checked before any rank starts (``runtime.job.JobSpec``)."""
        for name, value, least in (("--max-batch", self.max_batch, 1), ("--max-queue", self.max_queue, 0),
                                   ("--prefill-chunk", self.prefill_chunk, 1), ("--block-size", self.block_size, 1)):
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        self.cache.check_budget()
        missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
        if missing:
            raise RuntimeError(f"serve needs {', '.join(missing)}: pip install 'deinfer-megatron[serve]'")
        if self.cache.kind is CacheKind.LATENT and not rank_config.modules:
            raise ValueError(f"--kv-cache latent needs a decomposed model; {self.model} is dense "
                             "(decompose it with `deinfer-megatron decompose`, or use --kv-cache full)")
        if self.max_seq_len is not None and not 1 <= self.max_seq_len <= arch.max_positions:
            raise ValueError(f"--max-seq-len must be between 1 and the model's context of {arch.max_positions}, "
                             f"got {self.max_seq_len}")
        if self.block_size > self.tokens_per_sequence(arch):
            raise ValueError(f"--block-size {self.block_size} exceeds the {self.tokens_per_sequence(arch)} tokens of "
                             "a sequence (--max-seq-len); choose a smaller block")
        if self.cache.budget_gb is not None:  # a budget that holds no block: refused before any rank starts
            plan = make_plan(arch, rank_config, self.parallel.layout.fixed, tp=self.parallel.tp, pp=self.parallel.pp,
                             dtype_bytes=self.dtype.itemsize)
            per_token = plan.totals["kv_bytes_per_token"][self.cache.kind.value]
            pool_blocks(block_size=self.block_size, bytes_per_token=per_token, budget_gb=self.cache.budget_gb,
                        max_running=self.max_batch, max_seq_len=self.tokens_per_sequence(arch))

    def workload(self) -> Workload:
        """A decode step of every running sequence (a fixed layout: not priced)."""
        return Workload(tp=self.parallel.tp, batch=self.max_batch, dtype=self.dtype.value)

    def footprint(self, arch: ModelArch) -> Footprint:
        """The pool's KV tokens (under ``--kv-budget-gb``, at most that budget: counted by the
        ranks, ``blocks.pool_blocks``) and a step's rows: its prompt tokens and one per sequence."""
        longest = self.tokens_per_sequence(arch)
        tokens = 0 if self.cache.budget_gb is not None else self.max_batch * longest
        return Footprint(kv_tokens=tokens, kv_cache=self.cache.kind, prefill_rows=self.prefill_chunk + self.max_batch,
                         context=longest, logit_rows=self.max_batch, rows_option="--prefill-chunk")

    def check_plan(self, plan: LayoutPlan) -> None:
        if self.cache.kind is CacheKind.LATENT and not plan.supports_latent_cache:
            raise ValueError(f"--kv-cache latent needs --layout {latent_cache_layouts()} (whole latents on every rank)")


def listen(host: str, port: int) -> socket.socket:
    """Rank 0's HTTP socket, bound before the ranks join: gloo's sockets (and the launcher's)
    take ports from the same ephemeral range, so a port bound only once the model has loaded can
    be taken in between — and a port already in use is reported now, not after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise RuntimeError(f"could not serve on {host}:{port} ({err.strerror}); choose another --host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise RuntimeError(f"could not serve on {host}:{port} ({err.strerror}); choose another --port") from None
    sock.set_inheritable(False)
    return sock


class _Lead:
    """Rank 0: the scheduler, the HTTP thread, and the loop that feeds both."""

    def __init__(self, job: ServeJob, runner: StepRunner, blocks: int, max_seq_len: int, kv_bytes: int) -> None:
        import transformers

        self.job, self.runner = job, runner
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(job.model)
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are used by two threads here
        pool = BlockManager(blocks, job.block_size, prefix_caching=job.prefix_caching)
        self.scheduler = Scheduler(pool=pool, max_running=job.max_batch, max_seq_len=max_seq_len,
                                   max_queue=job.max_queue, decode=self.decode,
                                   eos_ids=eos_ids(job.model, self.tokenizer), prefill_chunk=job.prefill_chunk)
        self.metrics = ServerMetrics(kv_bytes)
        self.stats = StepStats()
        log.info("KV pool: %d blocks of %d tokens (%.1f MB per rank, %s cache), prefix caching %s", blocks,
                 job.block_size, kv_bytes / 2**20, job.cache.kind.value, "on" if job.prefix_caching else "off")
        self.failed = False
        self.http: Any = None

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, completion: Any) -> list[int]:
        with self.tokenizer_lock:
            if completion.messages is None:
                return list(self.tokenizer(completion.prompt, add_special_tokens=True)["input_ids"])
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model has no chat template; use /v1/completions")
            return list(self.tokenizer.apply_chat_template(completion.messages, add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"])

    def start_http(self, sock: socket.socket) -> None:
        """uvicorn on ``sock`` (bound by ``listen``) in a thread of its own."""
        import uvicorn

        state = ServerState(scheduler=self.scheduler, encode=self.encode, model_name=self.job.model_name,
                            api_key=self.job.api_key, metrics=self.metrics,
                            default_max_tokens=self.job.default_max_tokens, healthy=lambda: not self.failed,
                            stats=self.stats)
        config = uvicorn.Config(build_app(state), host=self.job.host, port=self.job.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=10)
        self.http = uvicorn.Server(config)

        def run_http() -> None:
            self.stats.http_thread = threading.get_native_id()
            self.http.run(sockets=[sock])

        thread = threading.Thread(target=run_http, name="http", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.http.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.job.host}:{self.job.port} did not start")
            time.sleep(0.05)
        self.thread = thread
        port = self.http.servers[0].sockets[0].getsockname()[1]
        log.info("serving %s on http://%s:%d/v1", self.job.model_name, self.job.host, port)

    def stop_http(self) -> None:
        if self.http is not None:
            self.http.should_exit = True
            self.thread.join(timeout=15)

    def loop(self, device: Any) -> None:
        scheduler, stats, clock = self.scheduler, self.stats, time.perf_counter
        while True:
            t0 = clock()
            scheduler.wait_for_work(HEARTBEAT_S)
            t1 = clock()
            plan = StepPlan(stop=True) if scheduler.draining and scheduler.idle() else scheduler.next_plan()
            t2 = clock()
            exchange_plan(plan, device)
            if plan.stop:
                return
            t3 = clock()
            tokens = self.runner.run(plan)
            t4 = clock()
            scheduler.complete(plan, tokens)
            for request in scheduler.take_finished():
                self.metrics.observe_finished(request)
            t5 = clock()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                stats.add(phase, seconds)
            if plan.rows:
                stats.step(plan.decoded, plan.prompt_tokens)
            pool = scheduler.pool
            stats.log_if_due(scheduler.running, scheduler.queue_length, pool.in_use, pool.blocks, pool.hit_rate)

    def fail(self, err: BaseException) -> None:
        """The loop broke: health fails, every request ends with an error."""
        self.failed = True
        self.scheduler.fail_all(f"the model ranks failed: {type(err).__name__}: {err}")
        time.sleep(1.0)  # the handlers send their errors before the server goes


@contextlib.contextmanager
def _lead_socket(job: ServeJob, rank: int) -> Iterator[socket.socket | None]:
    """Global rank 0's HTTP socket (``listen``), bound before the ranks join and closed after
    they are gone; nothing on the other ranks."""
    sock = listen(job.host, job.port) if rank == 0 else None
    try:
        yield sock
    finally:
        if sock is not None:
            sock.close()


def _serve_on_rank(ctx: RankContext) -> dict[str, Any] | None:
    """One rank of the server: the step loop; on global rank 0 also the scheduler and HTTP."""
    job, stage, sock = ctx.spec, ctx.stage, ctx.opened
    previous = signal.getsignal(signal.SIGTERM)
    try:
        longest = job.tokens_per_sequence(stage.arch)
        per_token = kv_bytes_per_token(stage, job.cache.kind)
        mine = pool_blocks(block_size=job.block_size, bytes_per_token=per_token, budget_gb=job.cache.budget_gb,
                           max_running=job.max_batch, max_seq_len=longest)
        agreed = comm.max_over_world(torch.tensor([-mine, per_token * job.block_size], dtype=torch.float64,
                                                  device=stage.device))
        blocks, block_bytes = int(-agreed[0].item()), int(agreed[1].item())
        context = PagedContext(blocks, job.block_size, longest, kv_cache=job.cache.kind,
                               absorb_values=job.cache.absorb_values)
        runner = StepRunner(stage, context)
        if not ctx.reports:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when every rank stops
            while not (plan := exchange_plan(None, stage.device)).stop:
                runner.run(plan)
            return None
        if not logging.getLogger().handlers:  # a rank this command spawned: its log lines as the command's
            logging.basicConfig(level=logging.INFO, format="[rank 0] %(levelname)s %(name)s: %(message)s")
            logging.getLogger("megatron").setLevel(logging.WARNING)
        try:
            assert sock is not None, "global rank 0 is the launcher's RANK 0"
            lead = _Lead(job, runner, blocks, longest, blocks * block_bytes)
            lead.start_http(sock)
        except BaseException:
            exchange_plan(StepPlan(stop=True), stage.device)  # the other ranks stop, not time out
            raise
        signal.signal(signal.SIGTERM, lambda signum, frame: lead.scheduler.drain())
        try:
            lead.loop(stage.device)
        except Exception as err:
            lead.fail(err)
            raise RuntimeError(f"the server stopped: {err}") from err
        finally:
            lead.stop_http()
        return {"served_model_name": job.model_name, "blocks": blocks, "block_size": job.block_size,
                "kv_cache_bytes": blocks * block_bytes, "drained": True}
    finally:
        signal.signal(signal.SIGTERM, previous)


def validate(job: ServeJob) -> None:
    """Every check ``run_serve`` makes before its ranks start (a command that starts a launcher)."""
    load_arch(job.model)  # a missing folder or config.json is named first
    check_job(job)


def run_serve(job: ServeJob) -> dict[str, Any] | None:
    """Serve until SIGTERM (the result on the reporting process) or until a rank fails (raises)."""
    load_arch(job.model)  # a missing folder or config.json is named first
    return run_prepared(prepare(job), _serve_on_rank, before_groups=partial(_lead_socket, job))
