"""Configuration, read in one place: the command line becomes a frozen
`ServerConfig` holding an `EngineConfig`; nothing else reads argv or env."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

from mstar.errors import ConfigError
from mstar.placement import PlacementSpec, parse_spec

DEFAULT_MODEL = "tiny-llama"
API_KEY_ENV = "MSTAR_API_KEY"


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-mode caps of one step and the paged KV cache geometry."""

    max_num_seqs: int = 256            # rows in one step, and running rows per KV component
    max_num_batched_tokens: int = 8192  # packed tokens in one step
    page_size: int = 16                 # tokens per KV page
    num_pages: int | None = None        # None: sized from kv_cache_memory
    kv_cache_memory: float = 0.25       # GiB per KV component when num_pages is None (CPU)
    gpu_memory_utilization: float = 0.9
    # "request": a request's first step reserves pages for its prompt plus max_tokens, so a running
    # request never runs short; "lazy": pages are taken as tokens arrive, and when the pool runs
    # dry the youngest running rows are preempted (their KV swapped to host memory) and resumed later;
    # "auto": "request" for a request whose max_tokens leaves some of the context, "lazy" for one that
    # may fill it (no max_tokens), and only such rows are preempted
    kv_reservation: str = "auto"
    state_slots: int | None = None      # rows with per-row state at once (None: max_num_seqs)
    prefix_caching: bool = True         # rows share the KV pages of prompt prefixes seen before
    admit_every: int = 0                # running groups' steps between two steps that start new rows (0: any time)
    # new rows wait until arrivals pause this long (50 ms at most), so that a burst's prompts start in one step
    # (`scheduler/burst_gate.py`; 0, the default: each starts as soon as its turn comes; on an H100 a served
    # 64-stream burst's first audio did not move with 2 ms, and a lone request would pay them)
    admission_gather_ms: float = 0.0
    mixed_steps: bool = True            # new rows' prompt tokens ride in running decode groups' steps
    # decode steps a running group's launch runs back to back while no new row waits (its host work per step
    # divided by them; a row's stop is seen when the launch is read, its later tokens dropped); None: auto,
    # several for a group whose tokens no client reads as they come (`LaunchSteps.of`)
    num_scheduler_steps: int | None = 1


@dataclass(frozen=True)
class EngineConfig:
    """What the engine serves and where."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # the name clients use; default: `model`
    served_model_aliases: tuple[str, ...] = ()  # more names they may use (--served-model-name's later ones)
    load_format: str = "auto"             # auto | dummy
    devices: tuple[str, ...] = ("cpu",)
    placement: PlacementSpec = field(default_factory=PlacementSpec)  # which devices run which components
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    seed: int = 0
    max_waiting_requests: int = 1024      # submitted, not yet producing output; beyond it new ones wait, then 429
    queue_timeout: float = 10.0           # seconds a new request waits for room before its 429
    request_timeout: float = 600.0        # seconds a request may run in all; past it, it ends with "timeout" (0: none)
    attention_backend: str = "auto"       # auto | torch | flashinfer (auto: flashinfer on CUDA)
    host_arena_mb: int | None = None      # per worker, for staged outputs (None: 64 on CUDA, none on CPU)
    gil_switch_interval_ms: float | None = None  # Python's thread switch interval while serving (None: as is)
    enforce_eager: bool = False           # no CUDA graphs
    quantization: str | None = None       # None | fp8: the projections' weights (opt-in: it changes the output)
    kv_cache_dtype: str = "auto"          # auto (the model's dtype) | fp8: K and V pages in float8 e4m3 (opt-in)
    audio_logits_only: bool = False       # a speech model's head computes its audio ids' logits only (opt-in)
    # where text requests' default sampling comes from: auto (the served folder's generation_config.json) | none
    # (SamplingParams' own) | a folder holding a generation_config.json
    generation_config: str = "auto"
    # decode graphs' batch sizes; None: `default_graph_buckets` of the scheduler's max_num_seqs
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.cuda_graph_batch_sizes is None:
            object.__setattr__(self, "cuda_graph_batch_sizes", default_graph_buckets(self.scheduler.max_num_seqs))


def default_media_workers() -> int:
    """Helper processes decoding requests' audio and images: one per 8 CPUs
    this process may run on, 1 to 16. A 2-core box decodes one at a time
    beside the event loop and the device worker; a 128-core one decodes 16 at
    a time (each process is spawned only when decodes overlap that much)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cpus // 8))


@dataclass(frozen=True)
class MediaLimits:
    """How much of a request's media the server decodes: a clip's seconds, an
    image's pixels (refused from its header, before a pixel is decoded). What
    fits a model's context is the model's to say, once the media are decoded."""

    max_audio_seconds: float = 600.0      # per clip
    max_image_pixels: int = 4096 * 4096   # per image


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's settings plus the engine's."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    log_format: str = "console"           # console | json
    log_level: str = "info"
    api_key: str | None = None            # bearer key every route but /health and the demo's files asks for
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets call ("*": any); none: no CORS headers
    header_timeout: float = 10.0          # seconds for a request's header block to arrive (0: none)
    body_timeout: float = 60.0            # seconds for a body to arrive in full (0: none); streamed-in: idle
    media_workers: int = field(default_factory=default_media_workers)  # processes decoding audio and images
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    profiling: bool = False               # POST /debug/profile: torch's profiler over a worker while serving
    event_loop: str = "asyncio"           # asyncio | uvloop | auto (uvloop when installed)


def parse_devices(spec: str) -> tuple[str, ...]:
    """`cpu` | `cpu:0,cpu:1` | `0` | `0,1` -> torch device strings."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part == "cpu" or part.startswith("cpu:"):
            out.append(part)
        elif part.isdigit():
            out.append(f"cuda:{part}")
        elif part.startswith("cuda:") and part[5:].isdigit():
            out.append(part)
        else:
            raise ConfigError(f"--gpus: cannot read device '{part}'")
    if not out:
        raise ConfigError("--gpus: no device given")
    if len(set(out)) != len(out):
        raise ConfigError("--gpus: a device is listed twice")
    return tuple(out)


# The default decode graphs stop here, however many rows a step may hold: each
# bucket keeps its own logits and a capture at startup, and the memory reserve
# (engine/memory/sizing.py) is sized for buckets up to 512 rows.
GRAPH_MAX_BATCH_CAP = 512


def default_graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The decode graphs when none are asked for: every step `max_num_seqs`
    allows, up to GRAPH_MAX_BATCH_CAP rows (a step past the last bucket runs
    eagerly, its launches on the host)."""
    return graph_buckets(min(max_num_seqs, GRAPH_MAX_BATCH_CAP))


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The decode graphs' batch sizes up to `max_batch`, and `max_batch`
    itself: 1, 2, 4, 8, 12, then four to a doubling (16, 20, 24, 28, 32, 40,
    48, 56, 64, 80, ...) and eight from 256 (288, 320, ...). A step replays
    the smallest bucket that holds its rows, and from a few dozen rows up a
    padding row costs its projections, LM head and draw: a quarter at most
    (73 rows replay 80, not 128), an eighth from 256 rows, where a step's
    time grows with its rows (400 replay 416, not 512). Each bucket keeps
    its own logits, so the grid is no finer."""
    if max_batch < 1:
        raise ConfigError("--cuda-graph-max-batch must be positive")
    out = [b for b in (1, 2, 4, 8, 12) if b < max_batch]
    octave = 16
    while octave < max_batch:
        step = octave // (8 if octave >= 256 else 4)
        out += [b for b in range(octave, 2 * octave, step) if b < max_batch]
        octave *= 2
    return tuple(out + [max_batch])


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a flag's default to its help, unless it has none to show (None,
    off, empty) or its help already says what it is; wraps lines at spaces
    only, so model names and flags stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == "" or "default" in text:
            return text
        return super()._get_help_string(action)


def version() -> str:
    """The installed package's version ("unknown" when run from a bare checkout)."""
    try:
        return importlib.metadata.version("mstar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def scheduler_steps(text: str) -> int | None:
    """`--num-scheduler-steps`: "auto" (None) or a positive number."""
    if text == "auto":
        return None
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ConfigError(f"--num-scheduler-steps must be auto or a positive number, not {text!r}")
    return steps


def build_parser(builtin_models: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The command line; `builtin_models`: the names `--model` takes without a folder, for `--help`."""
    epilog = f"built-in models (served without a folder): {', '.join(builtin_models)}" if builtin_models else None
    p = argparse.ArgumentParser(prog="python -m mstar.http", description="Serve a model over HTTP.",
                                epilog=epilog, formatter_class=_DefaultsHelp)
    p.add_argument("--version", action="version", version=f"mstar {version()}")
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in model name or a local Hugging Face folder")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use (default: --model); an answer echoes the name its request used (vLLM's)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto: the folder's weights; dummy: random weights of the same shapes (benchmarks)")
    p.add_argument("--gpus", default="cpu", help="cpu | cpu:0,cpu:1 | 0 | 0,1: one worker thread per device")
    p.add_argument("--placement", default="replicas",
                   help="replicas (every device runs the whole model) | split (the model's own split, e.g. "
                        "Orpheus: llm, then codec on the last device) | component[.mode]=device[+device],... "
                        "with devices by --gpus index or name, e.g. llm=0,codec=1 or llm=0+1,codec=1")
    p.add_argument("--placement-file", default=None, help="the same as a JSON or YAML mapping")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and activations; auto: float32 on CPU, bfloat16 on a GPU")
    p.add_argument("--generation-config", default="auto",
                   help="auto: a text request's unset temperature, top_p, top_k, min_p, repetition_penalty and "
                        "max_tokens come from the model folder's generation_config.json; none (or vllm): from "
                        "the API's defaults; a folder: from its generation_config.json")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens, at most the model's positions (default: from the model)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests running (holding KV pages) per device, and rows in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="packed tokens in one step, a decode row's token included (at least --max-num-seqs)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages per KV component (default: from memory)")
    p.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB of KV cache on CPU")
    p.add_argument("--state-slots", type=int, default=None,
                   help="rows of a recurrent component's per-row state held at once (default: --max-num-seqs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use")
    p.add_argument("--kv-reservation", choices=("auto", "request", "lazy"), default="auto",
                   help="request: reserve prompt + max_tokens pages at the start; lazy: take pages as tokens "
                        "arrive, and preempt (swap out) the youngest rows when they run out; auto: reserve for a "
                        "request whose max_tokens leaves some of the context, lazy for one that may fill it")
    p.add_argument("--admit-every", type=int, default=0,
                   help="while requests are decoding, steps they take between two prefill steps of new requests: "
                        "arrivals then share fewer, larger prefill steps (0: a prefill whenever its turn comes)")
    p.add_argument("--admission-gather-ms", type=float, default=0.0,
                   help="where no requests are running, new ones start once arrivals have paused this many ms "
                        "(50 ms at most after the first of a burst), so that a burst of requests starts in one "
                        "prefill step instead of many small ones; a request that comes alone waits this long "
                        "(default 0: each starts when its turn comes)")
    p.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                   help="run new requests' prompts in steps of their own instead of inside running decode steps "
                        "(by default they ride in them)")
    p.add_argument("--num-scheduler-steps", default="1", metavar="{auto,N}",
                   help="decode steps a running batch takes per launch while no new request waits to start: the "
                        "host's work per step (planning, reading tokens back, routing, the event loop's report) "
                        "is paid once per launch; a request that stops mid-launch computes the launch's remaining "
                        "steps for nothing, and its output is unchanged. auto: 4 for batches whose tokens reach "
                        "clients only through another component (Orpheus's speech, through its codec), 1 where a "
                        "client reads them as they come (text streams) (default 1: served speech measured no "
                        "faster with 4, and its chunks came less evenly)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt's KV, even where a full page of its prefix was computed before "
                        "(by default the prefix cache is on)")
    p.add_argument("--seed", type=int, default=0, help="engine seed, for requests without their own")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests waiting to start; a new one past this waits --queue-timeout, then gets 429")
    p.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a new request waits for room")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run from submission to its end (0: no limit); past it, 504 or an "
                        "error event")
    p.add_argument("--attention-backend", choices=("auto", "torch", "flashinfer"), default="auto",
                   help="auto: FlashInfer on CUDA, the torch reference on CPU")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: the decoder layers' projections of the language models in float8 (e4m3 weights with "
                        "a scale per output row, inputs quantized per row); heads, embeddings, encoders and "
                        "vocoders stay. Changes the output; CUDA needs compute capability 8.9+ and bfloat16")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="auto: K and V pages in the model's dtype; fp8: in float8 e4m3 (scale 1), half the bytes "
                        "a decode step reads and twice the tokens in the same memory. Changes the output; "
                        "CUDA needs compute capability 8.9+, and decodes through TensorRT-LLM's XQA kernel "
                        "(FlashInfer) on 9.0+")
    p.add_argument("--audio-logits-only", action="store_true",
                   help="Orpheus models: the LM head computes the logits of Orpheus's own 28,684 special and "
                        "audio ids only, not Llama's 128,256 text ids, so a step's head and draw read 18%% of the "
                        "vocabulary; only speech is served (/v1/audio/speech, /v1/realtime; /generate's "
                        "'generate' walk is refused). Changes the output "
                        "where the model would have drawn a text id (its probabilities are renormalised over "
                        "the window), and a stop id outside it (Orpheus's <|eot_id|>) can no longer end a request")
    p.add_argument("--gil-switch-interval-ms", type=float, default=None,
                   help="how long a thread may hold the GIL while another waits (Python's default: 5 ms); the "
                        "worker threads and the event loop share it")
    p.add_argument("--event-loop", choices=("asyncio", "uvloop", "auto"), default="asyncio",
                   help="the HTTP side's asyncio loop (auto: uvloop when installed). The standard library's is the "
                        "default: uvloop holds the GIL through each socket write, so with many streams the device "
                        "workers wait for it")
    p.add_argument("--host-arena-mb", type=int, default=None,
                   help="MiB of shared, page-locked host memory per worker for outputs on their way to clients "
                        "(default: 64 on a GPU, none on the CPU)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="capture decode graphs for batch sizes 1, 2, 4, 8, 12, 16, 20, ... (four to a doubling, "
                        f"eight from 256) up to this (default: --max-num-seqs, at most {GRAPH_MAX_BATCH_CAP})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--log-format", choices=("console", "json"), default="console", help="log line format")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the demo page "
                        f"(default: ${API_KEY_ENV})")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call (CORS), e.g. https://app.example.com; "
                        "* allows any; none: no CORS headers")
    p.add_argument("--enable-profiling", dest="profiling", action="store_true",
                   help="serve POST /debug/profile: torch's profiler over a few seconds of a worker while it "
                        "serves, answered as text (it slows that worker while it runs)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's header block may take to arrive; past it the connection closes "
                        "(0: no limit)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive in full; past it, 408 and the connection "
                        "closes (0: no limit). Text streamed into speech may instead pause this long")
    p.add_argument("--media-workers", type=int, default=None,
                   help="helper processes decoding requests' audio and images, started as needed (default: one "
                        "per 8 CPUs, 1 to 16)")
    p.add_argument("--max-audio-seconds", type=float, default=MediaLimits.max_audio_seconds,
                   help="longest audio clip a chat message may hold, in seconds; a longer one is a 400 (a clip "
                        "must also fit the model's context: Qwen3-Omni makes about 13 tokens a second)")
    p.add_argument("--max-image-pixels", type=int, default=MediaLimits.max_image_pixels,
                   help="largest image (width x height) a chat message may hold; a larger one is a 400, read "
                        "from its header before it is decoded")
    return p


def _check_numbers(a: argparse.Namespace) -> None:
    """The numeric flags within their bounds, refused before anything starts:
    past them a value fails later naming no flag (a NaN pool size, a negative
    page count) or quietly means something else (0 pages as "from memory")."""
    for name in ("header_timeout", "body_timeout", "queue_timeout", "request_timeout"):
        if math.isnan(getattr(a, name)) or math.isinf(getattr(a, name)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number of seconds (0: no limit)")
    if a.num_pages is not None and a.num_pages < 1:
        raise ConfigError("--num-pages must be positive (leave it out to size the pool from memory)")
    if not (a.kv_cache_memory > 0 and math.isfinite(a.kv_cache_memory)):
        raise ConfigError("--kv-cache-memory must be a positive number of GiB")
    if not 0 < a.gpu_memory_utilization <= 1:
        raise ConfigError("--gpu-memory-utilization must be a share of the GPU's memory, in (0, 1]")
    # Python refuses a switch interval of 0 or less with a traceback at engine start, and takes NaN as 9e12 s
    if a.gil_switch_interval_ms is not None and not (a.gil_switch_interval_ms > 0
                                                     and math.isfinite(a.gil_switch_interval_ms)):
        raise ConfigError("--gil-switch-interval-ms must be a positive number of milliseconds")
    if a.host_arena_mb is not None and a.host_arena_mb < 0:
        raise ConfigError("--host-arena-mb must not be negative (0: no arena)")
    if a.max_num_batched_tokens < a.max_num_seqs:
        raise ConfigError(f"--max-num-batched-tokens ({a.max_num_batched_tokens}) must be at least --max-num-seqs "
                          f"({a.max_num_seqs}): a decode step packs a token for each running request")


def parse_args(argv: list[str] | None = None, builtin_models: Sequence[str] = ()) -> ServerConfig:
    a = build_parser(builtin_models).parse_args(argv)
    if a.max_model_len is not None and a.max_model_len < 1:
        raise ConfigError("--max-model-len must be positive")
    if not 0 <= a.port <= 65535:
        raise ConfigError("--port must be between 0 and 65535")
    if a.header_timeout < 0 or a.body_timeout < 0:
        raise ConfigError("--header-timeout and --body-timeout must not be negative")
    if a.max_waiting_requests < 0 or a.queue_timeout < 0 or a.request_timeout < 0:
        raise ConfigError("--max-waiting-requests, --queue-timeout and --request-timeout must not be negative")
    if a.max_waiting_requests < 1:  # a line that holds no one would refuse every request, on an idle server too
        raise ConfigError("--max-waiting-requests must be at least 1")
    for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    _check_numbers(a)
    names = tuple(dict.fromkeys(a.served_model_name or ()))  # each once, in the order given
    if a.admit_every < 0:
        raise ConfigError("--admit-every must be 0 or more")
    if not (a.admission_gather_ms >= 0 and math.isfinite(a.admission_gather_ms)):
        raise ConfigError("--admission-gather-ms must be 0 or a positive number of milliseconds")
    if a.state_slots is not None and a.state_slots < 1:
        raise ConfigError("--state-slots must be positive")
    if a.media_workers is not None and a.media_workers < 1:
        raise ConfigError("--media-workers must be positive")
    if not (a.max_audio_seconds > 0 and math.isfinite(a.max_audio_seconds)) or a.max_image_pixels < 1:
        raise ConfigError("--max-audio-seconds and --max-image-pixels must be positive")
    sched = SchedulerConfig(
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        page_size=a.page_size,
        num_pages=a.num_pages,
        kv_cache_memory=a.kv_cache_memory,
        gpu_memory_utilization=a.gpu_memory_utilization,
        kv_reservation=a.kv_reservation,
        state_slots=a.state_slots,
        prefix_caching=a.prefix_caching,
        admit_every=a.admit_every,
        admission_gather_ms=a.admission_gather_ms,
        mixed_steps=a.mixed_steps,
        num_scheduler_steps=scheduler_steps(a.num_scheduler_steps),
    )
    engine = EngineConfig(
        model=a.model,
        served_model_name=names[0] if names else None,
        served_model_aliases=names[1:],
        load_format=a.load_format,
        devices=parse_devices(a.gpus),
        placement=parse_spec(a.placement, a.placement_file),
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        seed=a.seed,
        max_waiting_requests=a.max_waiting_requests,
        queue_timeout=a.queue_timeout,
        request_timeout=a.request_timeout,
        attention_backend=a.attention_backend,
        enforce_eager=a.enforce_eager,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
        audio_logits_only=a.audio_logits_only,
        generation_config=a.generation_config,
        host_arena_mb=a.host_arena_mb,
        gil_switch_interval_ms=a.gil_switch_interval_ms,
        cuda_graph_batch_sizes=None if a.cuda_graph_max_batch is None else graph_buckets(a.cuda_graph_max_batch),
        scheduler=sched,
    )
    return ServerConfig(engine=engine, host=a.host, port=a.port, log_format=a.log_format,
                        log_level=a.log_level, api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
                        allowed_origins=tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip()),
                        header_timeout=a.header_timeout, body_timeout=a.body_timeout,
                        media_workers=a.media_workers or default_media_workers(),
                        media_limits=MediaLimits(a.max_audio_seconds, a.max_image_pixels), profiling=a.profiling,
                        event_loop=a.event_loop)
