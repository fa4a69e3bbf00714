"""Serving latency under Poisson arrivals, over OpenAI's HTTP API (works against any OpenAI-compatible server:
mini-infer, vLLM, SGLang).

For each request rate in --rates (requests/s; `inf` sends every request at once) it sends --num-prompts
streaming requests with exponential inter-arrival times (seeded) and measures, per request: TTFT (time to the
first chunk with content), inter-token latencies (ITL: gaps between content chunks; a chunk may carry more than
one token, output tokens are counted from the stream's `usage`), end-to-end latency and output tokens. Per rate:
request and output-token throughput, TTFT / ITL / E2E p50 and p99, failures.

Prompts are text, not token ids (ids are not portable across servers): words drawn with a seeded RNG from a fixed
list of common English words, one word per requested input token (most are one token with a leading space in
BPE vocabularies); where the server has `/tokenize` (mini-infer, vLLM), the real prompt token counts are asked for
and reported. Each rate gets its own prompts (same lengths, other words), so that a prefix cache does not carry
over from one rate to the next. Requests send `max_tokens` = the drawn output length, `temperature: 0`,
`ignore_eos: true` (a vLLM extra; a server that rejects it is retried without, and the JSON says so), `stream: true`
with `stream_options: {"include_usage": true}`. One warm-up request (not counted) runs first.

Only loopback traffic by default: a --base-url whose host is not a loopback address (127.0.0.1, localhost, ::1)
is refused unless --allow-remote is given.

Prints a table (one row per rate), writes `serving.json` (every request's numbers, the summaries, and meta: base
URL, model, date, git commit) and `serving.png` (TTFT and ITL p50/p99 against rate) to --out (default bench/out/).

    python bench/serving.py --launch "--dry-run --max-model-len 2048" --rates 1,2,4,inf   # starts mini-infer
    python bench/serving.py --base-url http://127.0.0.1:8000/v1 --rates 1,4,inf --num-prompts 200
    python bench/serving.py --endpoint chat --input-len 256,1024 --output-len 64,256
    python bench/serving.py --launch "--dry-run" --long-prefill 8000 --rates 4   # head-of-line probe first

`--peers vllm` (with `--launch`) runs the same request stream against `vllm serve` too, one server after the
other: with `--preset NAME` both load one model directory written from the preset (config + the embedded
tokenizer, bench/vllm_peer.py), mini-infer as `serve DIR --dry-run LAUNCH-ARGS` and vLLM as `vllm serve DIR
--load-format dummy --max-model-len N` (its defaults otherwise); serving.json gets vLLM's report under "peers".

    python bench/serving.py --preset qwen3-0.6b --launch "--max-model-len 2048" --peers vllm --rates 4,16,64

`--long-prefill WORDS` first runs a head-of-line probe (before the rates): one streaming request of WORDS words
(max_tokens 1), then, while it prefills, --long-prefill-shorts requests of 16 words (max_tokens 16) 50 ms apart;
it reports the long request's TTFT beside each short one's (a short request stuck behind the whole prefill has
a TTFT close to the long one's). Results go to serving.json under "long_prefill_probe".
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from kernel_norm import git_info  # the sibling script's HEAD and dirty files

# 258 common English words, no repeats: the prompt vocabulary (fixed: changing it changes every prompt).
WORDS = """
the of and to in is was for on that with as by at from his her an be are this which or had not but were
have they one you all their has been there who when more would she will so if its into out up time other
about some can them no only these than two new may then first also over after any such like our could
most where much made through back years way well down should because each just those people how too
little state good very make world still see own men work long here get both between life being under
never day same another know while last might great old year off come since against go came right used take
three house small found part again home place around however number without point water bird power clear
hand high land light music night often open paper plant river road school side sound story table tree word
young book change close color early face family field fire follow food form friend game green group head
heart idea keep kind large learn leave letter line list live move name near next order page play real red
rest room run seem ship short show sing sit size slow south star start stop study sun system talk tell
test thing think together town turn walk warm watch wind window winter wood write yellow answer ask begin
black blue body bring build carry cause center city class cold common country cover cross cut dark deep
""".split()

ALLOWED_HOSTS = {"localhost", "localhost.localdomain"}
ROUTES = {"completions": "completions", "chat": "chat/completions"}


# ----------------------------------------------------------------------------------------------- arguments
def parse_range(text: str) -> tuple[int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"expected 'min,max' with 1 <= min <= max, got {text!r}")
    return parts[0], parts[1]


def parse_rates(text: str) -> list[float]:
    rates = []
    for p in text.split(","):
        r = math.inf if p.strip().lower() in ("inf", "infinity") else float(p)
        if not r > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {p!r}")
        rates.append(r)
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def check_loopback(url: str, allow_remote: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SystemExit(f"serving.py: error: --base-url must be http(s)://HOST[:PORT]/v1, got {url!r}")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in ALLOWED_HOSTS
    if not loopback and not allow_remote:
        raise SystemExit(f"serving.py: error: refusing to send load to {host!r}: only loopback hosts (127.0.0.1, "
                         "localhost, ::1) by default. Pass --allow-remote to benchmark a server elsewhere, "
                         "if that server is yours to load.")


# ------------------------------------------------------------------------------------------------ prompts
def make_lengths(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int):
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, size=n).tolist()
    outs = rng.integers(output_len[0], output_len[1] + 1, size=n).tolist()
    return ins, outs


def make_prompts(word_counts: list[int], seed: int, rate_index: int) -> list[str]:
    rng = np.random.default_rng([seed, rate_index, 0])
    return [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=k)) for k in word_counts]


def poisson_arrivals(n: int, rate: float, seed: int, rate_index: int) -> list[float]:
    """Send times in seconds from the start of the run: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, rate_index, 1]).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


# ------------------------------------------------------------------------------------------------- client
@dataclass
class RequestResult:
    index: int
    prompt_words: int
    max_tokens: int
    prompt_tokens: int | None = None  # from /tokenize, when the server has it
    usage_prompt_tokens: int | None = None  # from the stream's usage (chat: includes the template)
    scheduled_s: float = 0.0  # Poisson send time, from the start of the rate's run
    sent_s: float = 0.0  # actual send time, same origin
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    output_tokens: int = 0
    tokens_from_usage: bool = False
    finish_reason: str | None = None


def _error_text(body: str) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


class OpenAIClient:
    def __init__(self, base_url: str, api_key: str | None, endpoint: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.endpoint = endpoint
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=30.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.model: str | None = None
        self.ignore_eos = True
        self.stream_usage = True
        self.notes: list[str] = []

    async def close(self) -> None:
        await self.http.aclose()

    async def default_model(self) -> str:
        try:
            r = await self.http.get(f"{self.base_url}/models")
        except httpx.HTTPError as exc:
            raise SystemExit(f"serving.py: error: GET {self.base_url}/models: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise SystemExit(f"serving.py: error: GET {self.base_url}/models: HTTP {r.status_code}: "
                             f"{_error_text(r.text)}")
        data = r.json().get("data") or []
        if not data:
            raise SystemExit(f"serving.py: error: GET {self.base_url}/models lists no model; pass --model")
        return data[0]["id"]

    async def server_version(self) -> str | None:
        try:
            r = await self.http.get(f"{self.root}/version", timeout=10)
            return r.json().get("version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def body(self, prompt: str, max_tokens: int) -> dict:
        if self.endpoint == "completions":
            b = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
        else:
            b = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                 "max_completion_tokens": max_tokens}
        b.update(temperature=0, stream=True)
        if self.stream_usage:
            b["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b

    async def count_tokens(self, prompts: list[str]) -> list[int | None]:
        """Prompt token counts from the server's /tokenize (mini-infer's and vLLM's shape); Nones without it."""
        sem = asyncio.Semaphore(8)

        async def one(p: str) -> int | None:
            if self.endpoint == "completions":
                body = {"model": self.model, "prompt": p}
            else:
                body = {"model": self.model, "messages": [{"role": "user", "content": p}]}
            async with sem:
                try:
                    r = await self.http.post(f"{self.root}/tokenize", json=body, timeout=30)
                    obj = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    return None
            if "count" in obj:
                return int(obj["count"])
            return len(obj["tokens"]) if isinstance(obj.get("tokens"), list) else None

        first = await one(prompts[0]) if prompts else None
        if first is None:
            return [None] * len(prompts)
        return [first, *await asyncio.gather(*(one(p) for p in prompts[1:]))]

    async def _stream(self, res: RequestResult, body: dict, t_origin: float) -> int | None:
        """Runs one streaming request into `res`; returns the HTTP status of a refused request, else None."""
        url = f"{self.base_url}/{ROUTES[self.endpoint]}"
        start = time.perf_counter()
        res.sent_s = start - t_origin
        last = None
        usage = None
        done = False
        async with self.http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {_error_text((await resp.aread()).decode(errors='replace'))}"
                return resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except ValueError:
                    res.error = f"bad SSE data: {data[:200]!r}"
                    return None
                if obj.get("error"):
                    res.error = f"error event: {_error_text(data)}"
                    return None
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    text = ch.get("text") if self.endpoint == "completions" else (ch.get("delta") or {}).get("content")
                    if text:
                        if res.ttft_s is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.chunks += 1
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
        res.e2e_s = time.perf_counter() - start
        if not done:
            res.error = "stream ended without [DONE]"
            return None
        if usage and usage.get("completion_tokens") is not None:
            res.output_tokens, res.tokens_from_usage = int(usage["completion_tokens"]), True
            res.usage_prompt_tokens = usage.get("prompt_tokens")
        else:
            res.output_tokens = res.chunks
        if res.ttft_s is None:  # no content at all (e.g. every token decoded to ""): TTFT is the whole request
            res.ttft_s = res.e2e_s
        res.ok = True
        return None

    async def request(self, res: RequestResult, prompt: str, t_origin: float) -> int | None:
        try:
            return await asyncio.wait_for(self._stream(res, self.body(prompt, res.max_tokens), t_origin),
                                          self.timeout)
        except asyncio.TimeoutError:
            res.error = f"timed out after {self.timeout:g}s"
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        return None

    async def probe(self) -> None:
        """One warm-up request (not counted). A 400/422 is retried without ignore_eos, then without
        stream_options, for servers that reject those fields; each fallback is noted."""
        prompt = " ".join(WORDS[:8])
        while True:
            res = RequestResult(-1, 8, 4)
            status = await self.request(res, prompt, time.perf_counter())
            if res.ok:
                if not res.tokens_from_usage:
                    self.notes.append("no usage in the stream: output tokens are counted as content chunks")
                return
            if status in (400, 422) and self.ignore_eos:
                self.ignore_eos = False
                self.notes.append(f"server rejected ignore_eos ({res.error}); sent without it: outputs may end "
                                  "before max_tokens")
                continue
            if status in (400, 422) and self.stream_usage:
                self.stream_usage = False
                self.notes.append(f"server rejected stream_options ({res.error}); sent without it: output "
                                  "tokens are counted as content chunks")
                continue
            raise SystemExit(f"serving.py: error: warm-up request to {self.base_url} failed: {res.error}")


# --------------------------------------------------------------------------------------- head-of-line probe
async def long_prefill_probe(client: OpenAIClient, long_words: int, n_short: int, seed: int) -> dict:
    """TTFT of short requests sent while one long prompt prefills (see the module docstring)."""
    long_prompt, *shorts = make_prompts([long_words] + [16] * n_short, seed, 10_000)
    t0 = time.perf_counter()
    long_res = RequestResult(-1, long_words, 1)
    short_res = [RequestResult(i, 16, 16) for i in range(n_short)]

    async def short(i: int) -> None:
        await asyncio.sleep(0.2 + 0.05 * i)  # the long prompt is in its prefill by then
        await client.request(short_res[i], shorts[i], t0)

    await asyncio.gather(client.request(long_res, long_prompt, t0), *(short(i) for i in range(n_short)))
    ok = [r.ttft_s * 1e3 for r in short_res if r.ok]
    probe = {"long_words": long_words, "long_ok": long_res.ok, "long_error": long_res.error,
             "long_ttft_ms": long_res.ttft_s * 1e3 if long_res.ttft_s is not None else None,
             "short_ttft_ms": ok, "short_failed": n_short - len(ok),
             "short_ttft_p50_ms": float(np.percentile(ok, 50)) if ok else None,
             "short_ttft_max_ms": max(ok) if ok else None}
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"long-prefill probe: {long_words}-word prompt TTFT {f(probe['long_ttft_ms'])} ms; {len(ok)}/{n_short} "
          f"short requests sent during it: TTFT p50 {f(probe['short_ttft_p50_ms'])} ms, max "
          f"{f(probe['short_ttft_max_ms'])} ms", flush=True)
    return probe


# ---------------------------------------------------------------------------------------------- one rate
def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) * 1e3 if values else None


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    s = {"rate": rate_label(rate), "num_prompts": len(results), "completed": len(ok),
         "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration if duration else 0.0,
         "output_throughput": out_tokens / duration if duration else 0.0,
         "total_output_tokens": out_tokens, "total_input_tokens": sum(known) if known else None,
         "total_input_words": sum(r.prompt_words for r in ok),
         "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
         # text held back until the end (e.g. noise tokens that never complete a UTF-8 character): TTFT ~ E2E
         "single_chunk_outputs": sum(1 for r in ok if r.chunks <= 1 and r.output_tokens > 1),
         "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)) if ok else None}
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e), ("tpot", tpot)):
        s[f"mean_{name}_ms"] = _mean(vals)
        s[f"p50_{name}_ms"] = _pct(vals, 50)
        s[f"p99_{name}_ms"] = _pct(vals, 99)
    s["errors"] = sorted({r.error for r in results if r.error})[:5]
    return s


async def run_rate(client: OpenAIClient, rate: float, k: int, prompts: list[str], words: list[int],
                   out_lens: list[int], prompt_tokens: list[int | None], seed: int,
                   max_concurrency: int | None) -> tuple[dict, list[RequestResult]]:
    arrivals = poisson_arrivals(len(prompts), rate, seed, k)
    results = [RequestResult(i, words[i], out_lens[i], prompt_tokens[i], scheduled_s=arrivals[i])
               for i in range(len(prompts))]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            await client.request(results[i], prompts[i], t0)
        else:
            async with sem:
                await client.request(results[i], prompts[i], t0)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return summarize(rate, results, time.perf_counter() - t0), results


# ------------------------------------------------------------------------------------------ launched server
class LaunchedServer:
    """`mini-infer serve ARGS --host 127.0.0.1 --port FREE` (or `command(port)`, e.g. vLLM's server) as a
    subprocess, up once /health answers 200."""

    def __init__(self, launch_args: str, api_key: str | None, log_path: Path, timeout: float,
                 command=None) -> None:
        self.args = shlex.split(launch_args)
        self.command = command
        self.api_key = api_key
        self.log_path = log_path
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> LaunchedServer:
        cmd = self.command(self.port) if self.command else [
            sys.executable, "-m", "mini_infer.cli", "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.api_key and "--api-key" not in self.args:
            cmd += ["--api-key", self.api_key]
        self.cmd = cmd
        print(f"launching: {shlex.join(cmd)}  (log: {self.log_path})", flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # closed in __exit__
        # its own session, so that stopping it (and anything it started) cannot reach this process
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.perf_counter()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"serving.py: error: the launched server exited with status "
                                     f"{self.proc.returncode}; last log lines:\n{self._tail()}")
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > self.timeout:
                    raise SystemExit(f"serving.py: error: the launched server was not healthy after "
                                     f"{self.timeout:g}s; last log lines:\n{self._tail()}")
                time.sleep(0.5)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.perf_counter() - t0
        print(f"server healthy after {self.startup_s:.1f}s at {self.base_url}", flush=True)
        return self

    def _tail(self, n: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown, then the engine's
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGTERM)  # the group this script created for it
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self._log.close()


# ------------------------------------------------------------------------------------------------- output
def print_table(summaries: list[dict]) -> None:
    def f(x, w, d=1):
        return f"{'-':>{w}}" if x is None else f"{x:>{w}.{d}f}"

    print(f"{'rate':>6}{'ok/n':>8}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>9}"
          f"{'E2E p50':>10}{'p99':>10}   (ms)")
    for s in summaries:
        print(f"{s['rate']:>6}{str(s['completed']) + '/' + str(s['num_prompts']):>8}{s['request_throughput']:>8.2f}"
              f"{s['output_throughput']:>11.1f}{f(s['p50_ttft_ms'], 10)}{f(s['p99_ttft_ms'], 9)}"
              f"{f(s['p50_itl_ms'], 9)}{f(s['p99_itl_ms'], 9)}{f(s['p50_e2e_ms'], 10, 0)}{f(s['p99_e2e_ms'], 10, 0)}")


def plot(summaries: list[dict], meta: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    x = list(range(len(summaries)))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, name, title in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [s[f"{q}_{name}_ms"] if s[f"{q}_{name}_ms"] is not None else float("nan") for s in summaries]
            ax.plot(x, ys, style, label=q)
        ax.set_xticks(x, [s["rate"] for s in summaries])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{meta['model']}, {ROUTES[meta['endpoint']]} at {urlsplit(meta['base_url']).netloc} "
                 f"({meta['date'][:10]}, {meta['git']['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- main
def launch_and_bench(args: argparse.Namespace, launch: str, log_path: Path, command=None) -> dict:
    """Start one server (mini-infer's, or `command(port)`), run the whole benchmark against it, stop it."""
    with LaunchedServer(launch, args.api_key, log_path, args.launch_timeout, command) as srv:
        launched = {"cmd": srv.cmd, "startup_s": srv.startup_s}
        report = asyncio.run(bench(args, srv.base_url, launched))
    launched["exit_status"] = srv.proc.returncode
    return report


async def bench(args: argparse.Namespace, base_url: str, launched: dict | None) -> dict:
    client = OpenAIClient(base_url, args.api_key, args.endpoint, args.request_timeout)
    try:
        client.model = args.model or await client.default_model()
        version = await client.server_version()
        await client.probe()
        words, out_lens = make_lengths(args.num_prompts, args.input_len, args.output_len, args.seed)
        summaries, runs = [], []
        probe = await long_prefill_probe(client, args.long_prefill, args.long_prefill_shorts, args.seed) \
            if args.long_prefill else None
        for k, rate in enumerate(args.rates):
            prompts = make_prompts(words, args.seed, k)
            counts = await client.count_tokens(prompts)
            summary, results = await run_rate(client, rate, k, prompts, words, out_lens, counts, args.seed,
                                               args.max_concurrency)
            tok = f", {summary['total_input_tokens']} prompt tokens" if summary["total_input_tokens"] else ""
            print(f"rate {summary['rate']}: {summary['completed']}/{summary['num_prompts']} ok in "
                  f"{summary['duration_s']:.1f}s{tok}", flush=True)
            if summary["short_outputs"]:
                print(f"  {summary['short_outputs']} outputs ended before max_tokens")
            if summary["single_chunk_outputs"]:
                print(f"  {summary['single_chunk_outputs']} outputs came as one chunk (text held back to the end: "
                      "their TTFT is about their E2E)")
            for e in summary["errors"]:
                print(f"  error: {e}")
            summaries.append(summary)
            runs.append({"rate": summary["rate"], "requests": [asdict(r) for r in results]})
        if any(c is None for r in runs for c in (q["prompt_tokens"] for q in r["requests"])):
            client.notes.append("no /tokenize (or it failed): prompt lengths are in words, not tokens")
        return {"meta": {
            "base_url": base_url, "model": client.model, "endpoint": args.endpoint, "server_version": version,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "launched": launched,
            "rates": [rate_label(r) for r in args.rates], "num_prompts": args.num_prompts,
            "input_len_words": list(args.input_len), "output_len": list(args.output_len), "seed": args.seed,
            "max_concurrency": args.max_concurrency, "request_timeout_s": args.request_timeout,
            "ignore_eos_sent": client.ignore_eos, "stream_usage_requested": client.stream_usage,
            "notes": client.notes, "client_host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                   "python": platform.python_version()}},
            "summary": summaries, "runs": runs, "long_prefill_probe": probe}
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    ap.add_argument("--allow-remote", action="store_true",
                    help="allow a --base-url host that is not loopback (off: only 127.0.0.1/localhost/::1)")
    ap.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,inf"),
                    help="comma list of requests/s; inf sends all at once (default 1,2,4,inf)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    ap.add_argument("--input-len", type=parse_range, default=(128, 512), help="prompt words 'min,max', uniform")
    ap.add_argument("--output-len", type=parse_range, default=(64, 256), help="max_tokens 'min,max', uniform")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--launch", default=None, metavar="ARGS",
                    help="start `mini-infer serve ARGS` on a free loopback port for the run, then stop it")
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for its /health")
    ap.add_argument("--long-prefill", type=int, default=0, metavar="WORDS",
                    help="first run the head-of-line probe with a prompt of WORDS words (0: no probe)")
    ap.add_argument("--long-prefill-shorts", type=int, default=8, help="short requests sent during the probe")
    ap.add_argument("--peers", default="none", help="vllm: the same stream against `vllm serve` (needs --launch)")
    ap.add_argument("--preset", default=None,
                    help="launch every server from one directory written from this preset (see --peers)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.peers not in ("none", "vllm"):
        ap.error(f"--peers must be none or vllm, got {args.peers!r}")
    if (args.peers == "vllm" or args.preset) and args.launch is None:
        ap.error("--peers vllm and --preset need --launch (the servers this script starts)")
    first = (shlex.split(args.launch or "") or [""])[0]
    if args.peers == "vllm" and not args.preset and (not first or first.startswith("-")):
        ap.error("--peers vllm needs --preset NAME or a model path as the first --launch argument (vLLM loads it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.launch is not None:
        tokens = shlex.split(args.launch)
        if "--api-key" in tokens and not args.api_key and tokens.index("--api-key") + 1 < len(tokens):
            args.api_key = tokens[tokens.index("--api-key") + 1]
        model_path = None
        if args.preset:
            from vllm_peer import model_dir

            model_path = model_dir(args.preset)
            args.launch = shlex.join([str(model_path), "--dry-run", *tokens])
        report = launch_and_bench(args, args.launch, out / "serving_server.log")
        if args.peers == "vllm":
            from vllm_peer import serve_command

            max_len = int(tokens[tokens.index("--max-model-len") + 1]) if "--max-model-len" in tokens else None
            model_path = model_path or Path(tokens[0])
            try:
                report["peers"] = {"vllm": launch_and_bench(args, "", out / "serving_vllm.log",
                                                            lambda port: serve_command(model_path, port, max_len))}
            except SystemExit as exc:  # name what did not run, keep mini-infer's numbers
                print(f"vllm: did not run: {exc}", flush=True)
                report["peers"] = {"vllm": {"error": str(exc)}}
    else:
        check_loopback(args.base_url, args.allow_remote)
        report = asyncio.run(bench(args, args.base_url, None))

    meta = report["meta"]
    print(f"{meta['model']} via {meta['base_url']}/{ROUTES[meta['endpoint']]}: {args.num_prompts} requests per rate, "
          f"prompt {args.input_len[0]}-{args.input_len[1]} words, output {args.output_len[0]}-{args.output_len[1]} "
          f"tokens, seed {args.seed}")
    for note in meta["notes"]:
        print(f"note: {note}")
    print_table(report["summary"])
    for name, peer in (report.get("peers") or {}).items():
        if "summary" in peer:
            print(f"{name} ({peer['meta'].get('server_version') or 'version unknown'}), same stream:")
            print_table(peer["summary"])
    (out / "serving.json").write_text(json.dumps(report, indent=2))
    plot(report["summary"], meta, out / "serving.png")
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'}")


if __name__ == "__main__":
    main()
