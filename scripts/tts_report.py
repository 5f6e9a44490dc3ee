"""bench_tts.py's numbers and its markdown: what each streamed speech request
saw (chunk arrival times and sizes) in; per-request TTFA, RTF and stalls,
per-concurrency rows, `max_realtime_streams`, the environment and the
markdown table out. Pure Python (no torch, no aiohttp) so the arithmetic can
be checked on its own.

Definitions (PCM16 mono: 2 bytes a sample):
- TTFA: request sent -> first audio byte.
- RTF: (last byte - first byte) / seconds of audio received; "RTF total"
  counts from the request's send instead of its first byte.
- Streaming viability (SV): a player starts at the first byte and plays at
  the sample rate; a chunk that arrives after everything received before it
  has finished playing is a stall. After a stall the player resumes when the
  chunk arrives (it rebuffers), so one late chunk counts once instead of
  making every later chunk late too. The first chunk starts playback and is
  never a stall. SV = chunks on time / all chunks, over all requests.
"""

from __future__ import annotations

import datetime
import math
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_env import commit, version
from prometheus_samples import samples, totals

SAMPLE_BYTES = 2  # PCM16

# A level streams in real time when nearly every chunk plays without a gap
# and nearly every listener hears audio within a second.
REALTIME_SV = 0.99
REALTIME_TTFA_P99_MS = 1000.0

# M* on the H200 (orpheus-3b, dummy weights, 1024 audio tokens per request),
# measured in one device call with ours on 2026-12-01, printed beside a run's
# rows; None: not recorded.
REFERENCE = {
    1: {"ttfa_p50_ms": 127.0, "rtf_p50": 0.33, "audio_s_per_s": 3.0},
    16: {"ttfa_p50_ms": 278.0, "rtf_p50": 0.79, "audio_s_per_s": 20.2},
    64: {"ttfa_p50_ms": 1141.0, "rtf_p50": 2.72, "audio_s_per_s": 23.5},
}
REFERENCE_NOTE = ("M* on the same H200 in one device call with ours (2026-12-01), orpheus-3b with dummy weights, "
                  "1024 audio tokens per request")


@dataclass
class Stream:
    """One request as the client saw it, in `time.perf_counter()` seconds.
    A chunk is one HTTP chunk of the body (one write of the server)."""

    sent: float
    sample_rate: int = 24_000
    first_byte: float | None = None
    arrivals: list[float] = field(default_factory=list)   # when each chunk's last byte came
    sizes: list[int] = field(default_factory=list)        # its bytes
    end: float | None = None
    error: str | None = None
    refusals: int = 0  # 429/503 answers (with Retry-After) before the server took it

    def add(self, at: float, nbytes: int) -> None:
        self.arrivals.append(at)
        self.sizes.append(nbytes)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_byte is not None and sum(self.sizes) >= SAMPLE_BYTES

    @property
    def audio_s(self) -> float:
        return sum(self.sizes) // SAMPLE_BYTES / self.sample_rate

    @property
    def ttfa_s(self) -> float:
        assert self.first_byte is not None
        return self.first_byte - self.sent

    @property
    def rtf(self) -> float:
        assert self.first_byte is not None
        return (self.arrivals[-1] - self.first_byte) / self.audio_s

    @property
    def rtf_total(self) -> float:
        return (self.arrivals[-1] - self.sent) / self.audio_s

    def stalls(self) -> int:
        """Chunks that came after the player ran dry (see the module doc)."""
        assert self.first_byte is not None
        stalls = 0
        dry_at = self.first_byte  # when the audio received so far has finished playing
        for i, (at, nbytes) in enumerate(zip(self.arrivals, self.sizes)):
            if i and at > dry_at:
                stalls += 1
                dry_at = at  # the player waited for this chunk and resumes with it
            dry_at += nbytes / SAMPLE_BYTES / self.sample_rate
        return stalls


@dataclass
class Level:
    """Every request of one concurrency level and the level's wall time
    (first send to last end)."""

    concurrency: int
    streams: list[Stream]
    wall_s: float
    # the server's own first-audio seconds over the level (its `mstar_time_to_first_audio_seconds`, submit to first
    # chunk: sum and count between two /metrics reads); None: not read
    server_first_audio: tuple[float, float] | None = None

    @property
    def good(self) -> list[Stream]:
        return [s for s in self.streams if s.ok]

    @property
    def errors(self) -> list[str]:
        return [s.error or "no audio" for s in self.streams if not s.ok]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's
    default), so p99 of a few requests leans toward the worst one."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def level_row(level: Level) -> dict[str, Any] | None:
    """The JSON row of a level (exactly the schema's keys), or None when no
    request of it produced audio."""
    good = level.good
    if not good:
        return None
    ttfa_ms = [1e3 * s.ttfa_s for s in good]
    chunks = sum(len(s.sizes) for s in good)
    on_time = chunks - sum(s.stalls() for s in good)
    return {
        "concurrency": level.concurrency,
        "ttfa_p50_ms": round(percentile(ttfa_ms, 50), 1),
        "ttfa_p99_ms": round(percentile(ttfa_ms, 99), 1),
        "rtf_p50": round(percentile([s.rtf for s in good], 50), 3),
        "sv": round(on_time / chunks, 4),
        "audio_s_per_s": round(sum(s.audio_s for s in good) / level.wall_s, 2),
    }


def level_extras(level: Level) -> dict[str, Any]:
    """What the markdown shows besides the row: counts, the whole-request RTF
    and how much audio a request really carried (a model whose random weights
    write non-audio ids yields less than max_tokens // 7 frames)."""
    good = level.good
    return {
        "requests": len(level.streams),
        "errors": len(level.streams) - len(good),
        "refused": sum(s.refusals for s in level.streams),
        "rtf_total_p50": round(percentile([s.rtf_total for s in good], 50), 3) if good else math.nan,
        "audio_s_per_request": round(sum(s.audio_s for s in good) / len(good), 2) if good else 0.0,
        "chunks_per_request": round(sum(len(s.sizes) for s in good) / len(good), 1) if good else 0.0,
        "wall_s": round(level.wall_s, 1),
        "server_ttfa_mean_ms": server_ttfa_mean_ms(level),
    }


FIRST_AUDIO_METRIC = "mstar_time_to_first_audio_seconds"


def first_audio_totals(metrics_text: str) -> tuple[float, float] | None:
    """The sum and count of the server's first-audio histogram in its
    /metrics text, added over its label sets (a cluster front labels each
    replica's); None: not there (a sample whose value is no number is
    passed over, `prometheus_samples.py`)."""
    found = totals(samples(metrics_text))
    seconds, count = found.get(f"{FIRST_AUDIO_METRIC}_sum"), found.get(f"{FIRST_AUDIO_METRIC}_count")
    return None if seconds is None or count is None else (seconds, count)


def server_ttfa_mean_ms(level: Level) -> float:
    """The mean of the server's own first-audio times over the level (NaN
    when not read, or when it timed none): what of a client's TTFA the
    server spent between submitting the request and its first chunk."""
    if level.server_first_audio is None or level.server_first_audio[1] <= 0:
        return math.nan
    seconds, count = level.server_first_audio
    return round(1e3 * seconds / count, 1)


def max_realtime_streams(rows: Sequence[dict[str, Any]], extras: dict[int, dict[str, Any]]) -> int:
    """The largest concurrency whose SV and TTFA p99 meet the real-time bar
    and where no request failed (a failed stream is not real time); 0 if none."""
    fits = [r["concurrency"] for r in rows
            if r["sv"] >= REALTIME_SV and r["ttfa_p99_ms"] <= REALTIME_TTFA_P99_MS
            and extras.get(r["concurrency"], {}).get("errors", 0) == 0]
    return max(fits, default=0)


def expected_audio_s(audio_tokens: int, sample_rate: int = 24_000) -> float:
    """Seconds of audio in `audio_tokens` Orpheus tokens: 7 tokens a frame,
    2048 samples a frame at 24 kHz."""
    return audio_tokens // 7 * 2048 / sample_rate


# -- environment

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_names(indices: Sequence[int]) -> list[str]:
    """GPU names through nvidia-smi, so this process needs no CUDA context
    (one would take GPU memory beside the server's)."""
    names = []
    for i in indices:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", str(i)],
                                 capture_output=True, text=True, timeout=20, check=False)
            names.append(out.stdout.strip() or f"cuda:{i}")
        except (OSError, subprocess.SubprocessError):
            names.append(f"cuda:{i}")
    return names


def device_label(devices: Sequence[str]) -> str:
    """`NVIDIA H200`, `2 x NVIDIA H200`, or `cpu (<processor>)` for the
    server's devices as /health lists them."""
    cuda = [int(d.split(":", 1)[1]) for d in devices if d.startswith("cuda:")]
    if not cuda:
        return f"cpu ({cpu_name()})"
    names = gpu_names(cuda)
    distinct = sorted(set(names))
    if len(distinct) == 1:
        return distinct[0] if len(names) == 1 else f"{len(names)} x {distinct[0]}"
    return ", ".join(names)


def environment(devices: Sequence[str], model: str, server: str, repo: Path,
                settings: dict[str, str]) -> dict[str, str]:
    """The facts the markdown lists first; `settings` are the run's own."""
    import torch  # its version and CUDA build only; no device is touched

    return {
        "gpu": device_label(devices),
        "model": model,
        "server": server,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "flashinfer": version("flashinfer-python", "flashinfer"),
        "transformers": version("transformers"),
        "snac": version("snac"),
        "python": platform.python_version(),
        "mstar commit": commit(repo),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        **settings,
    }


# -- markdown

def _num(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def write_markdown(path: Path, result: dict[str, Any], extras: dict[int, dict[str, Any]],
                   env: dict[str, str], failed: dict[int, list[str]], audio_tokens: int) -> None:
    """tts.md: the environment, the rows beside M*'s reference, the
    baseline and what failed."""
    lines = ["# Streaming TTS under load: POST /v1/audio/speech over loopback", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", (f"Closed loop: at concurrency c, c clients each send a request, stream its PCM body to the "
                   f"end, and send the next. Every request asks for {audio_tokens} tokens with `ignore_eos` "
                   f"({expected_audio_s(audio_tokens):.2f} s of audio when all are audio tokens). "
                   "TTFA: first send -> first audio byte (a request the server refused with 429 is sent again "
                   "after Retry-After; refused counts those answers). RTF: (last byte - first byte) / audio "
                   "seconds; RTF total counts from the send. SV: share of chunks that arrive before a player "
                   "that started at the first byte runs dry (after a stall it resumes with the late chunk). "
                   "audio s/s: audio received / the level's wall time. Server TTFA: the mean of the server's "
                   "own submit -> first chunk over the level (`mstar_time_to_first_audio_seconds`; a server "
                   "that others use meanwhile counts their requests too). "
                   f"Real time: SV >= {REALTIME_SV} and TTFA p99 <= "
                   f"{REALTIME_TTFA_P99_MS:.0f} ms with no failed request."), ""]
    lines += [("| concurrency | requests | errors | refused | TTFA p50 ms | TTFA p99 ms | RTF p50 | RTF total p50 | "
               "SV | audio s/s | audio s / request | chunks / request | wall s | server TTFA mean ms |"),
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        x = extras[r["concurrency"]]
        lines.append(f"| {r['concurrency']} | {x['requests']} | {x['errors']} | {x['refused']} | "
                     f"{r['ttfa_p50_ms']:.0f} | "
                     f"{r['ttfa_p99_ms']:.0f} | {r['rtf_p50']:.2f} | {_num(x['rtf_total_p50'], '.2f')} | "
                     f"{r['sv']:.3f} | {r['audio_s_per_s']:.1f} | {x['audio_s_per_request']:.2f} | "
                     f"{x['chunks_per_request']:.0f} | {x['wall_s']:.0f} | {_num(x['server_ttfa_mean_ms'], '.0f')} |")
    lines += ["", f"max_realtime_streams: **{result['max_realtime_streams']}**", ""]
    lines += [f"Side by side with the reference ({REFERENCE_NOTE}):", "",
              "| concurrency | TTFA p50 ms | reference | RTF p50 | reference | audio s/s | reference |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    ours = {r["concurrency"]: r for r in result["rows"]}
    for c in sorted(set(ours) | set(REFERENCE)):
        r, ref = ours.get(c, {}), REFERENCE.get(c, {})
        lines.append(f"| {c} | {_num(r.get('ttfa_p50_ms'), '.0f')} | {_num(ref.get('ttfa_p50_ms'), '.0f')} | "
                     f"{_num(r.get('rtf_p50'), '.2f')} | {_num(ref.get('rtf_p50'), '.2f')} | "
                     f"{_num(r.get('audio_s_per_s'), '.1f')} | {_num(ref.get('audio_s_per_s'), '.1f')} |")
    if result["baseline"]:
        lines += ["", ("Baseline, offline (no streaming): transformers `generate` (LlamaForCausalLM of the same "
                       f"config, random weights, Orpheus's sampling, exactly {audio_tokens} new tokens), then the "
                       "snac package's 24 kHz decoder (random weights) over the whole utterance. audio s/s = "
                       f"batch x {expected_audio_s(audio_tokens):.2f} s / wall time of both."), "",
                  "| baseline | batch | audio s/s |", "|---|---:|---:|"]
        lines += [f"| {b['name']} | {b['batch']} | {b['audio_s_per_s']:.1f} |" for b in result["baseline"]]
    if failed:
        lines += ["", "Failed requests (first errors of each level):", ""]
        for c, errors in sorted(failed.items()):
            shown = "; ".join(dict.fromkeys(errors))[:400]
            lines.append(f"- concurrency {c}: {len(errors)} failed: {shown}")
    path.write_text("\n".join(lines) + "\n")
