"""Agents: what the OpenAI-compatible gateway costs per call, and episode throughput.

    python bench/agent.py [--calls 200] [--episodes 64] [--smoke]

(1) Prefix-tree packing against one sequence per call (`--parts 1`, bench/agent_packing.py): one
    training step of 8 episodes x 4 turns (~300-token tool outputs) on SmolLM2-135M, minutes on a CPU.
(2) Gateway overhead per call: the same request sent directly to an engine (`engine.generate`) and
    through the gateway with the real `openai` client over HTTP, paired call by call; overhead =
    gateway - direct. With a scripted engine (replies at no model cost, so the difference is all
    client library, HTTP, request checks, chat template, tokenization, tool parsing and episode
    bookkeeping), on multi-turn calls: turn t of an 8-turn episode whose environment turns are ~300
    tokens each. The openai client alone (the same call answered by a canned response in-process)
    is timed too: what the library costs is the same against any OpenAI-compatible server, so the
    gateway's share is openai - client alone - direct.
(3) Throughput: 64 concurrent episodes of examples/guess_number.py (4 calls each, 16 tokens per
    call) through the gateway on the tiny model with the transformers engine, against generating
    the same number of calls directly (same prompts, one request per call, all concurrent).
Last line: `name=value` pairs. --smoke: all three parts, (1) on the tiny model at bench/agent_packing.py's
smoke sizes, (2) one 8-turn episode, (3) 8 episodes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from _smoke import add_smoke_flag, tiny_model_folder
from sleuth.gateway.app import Gateway, GatewayServer
from sleuth.gateway.history import last_sampled_run
from sleuth.gateway.runner import EpisodeRunner, SharedHTTP, run_loop
from sleuth.records import SamplingParams
from sleuth.rollout.base import GenerationRequest
from sleuth.system.hardware import cpu_description
from sleuth.task_config import EpisodeConfig
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TURNS = 8
ENV_TEXT = "observation: " + " ".join(f"row{i}={i * 7 % 13}" for i in range(60))  # ~300 tokens (byte-level: more)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def overhead(calls: int) -> dict[str, list[float]]:
    """Seconds per call over multi-turn episodes with a scripted engine, paired call by call:
    `direct` (engine.generate), `openai` (the real client through the gateway over HTTP), `httpx`
    (the same request as plain JSON, stateless route) and `client` (the openai client alone against
    a canned response, no server: what the client library itself costs, any server's floor). The
    gateway serves on the episodes' event loop, as EpisodeRunner runs it."""
    tok = build_tokenizer()
    reply = "I will look at rows 3 and 7 next, then decide. " * 2
    engine = ScriptedEngine(tok, [reply], context_len=32768)
    gateway = Gateway(engine, tok, SamplingParams(max_tokens=200))
    times: dict[str, list[float]] = {k: [] for k in ("direct", "openai", "httpx", "client")}
    cpu = dict.fromkeys(times, 0.0)
    server = GatewayServer(gateway)
    canned: dict[str, bytes] = {}
    mock = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=canned["body"], headers={"content-type": "application/json"})))

    async def timed(key: str, call: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = await call
        times[key].append(time.perf_counter() - t)
        cpu[key] += time.process_time() - c
        return out

    async def run() -> None:
        async with server.serving(), SharedHTTP.open() as http:
            offline = openai.AsyncOpenAI(base_url="http://canned/v1", api_key="x", http_client=mock, max_retries=0)
            while len(times["openai"]) < calls:
                ep = gateway.store.open(SamplingParams(max_tokens=200, seed=0))
                client = openai.AsyncOpenAI(base_url=server.url(ep.id), api_key="x", http_client=http,
                                            max_retries=0)
                messages = [{"role": "user", "content": "Investigate the table. " + ENV_TEXT}]
                for _ in range(TURNS):
                    r = await timed("openai", client.chat.completions.create(model="policy", messages=messages))
                    prompt = engine.prompts[-1]
                    raw = await timed("httpx", http.post(server.url() + "/chat/completions", json={"messages": messages}))
                    canned["body"] = raw.content
                    await timed("client", offline.chat.completions.create(model="policy", messages=messages))
                    await timed("direct", engine.generate(GenerationRequest(prompt, 1, SamplingParams(max_tokens=200))))
                    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                                 {"role": "user", "content": ENV_TEXT}]
                gateway.store.close(ep.id)

    run_loop(run())  # the loop EpisodeRunner runs episodes on
    n = len(times["openai"])
    print("    CPU time per call (client and server share this process's one event loop): " +
          ", ".join(f"{k} {v / n * 1e3:.2f} ms" for k, v in cpu.items()), flush=True)
    return {k: v[:calls] for k, v in times.items()}


def throughput(episodes: int, model_dir: Path) -> dict[str, float]:
    """Episodes of guess_number through the gateway vs the same calls made directly."""
    sys.path.insert(0, str(ROOT))
    from examples import guess_number

    from sleuth.records import Problem
    from sleuth.rollout.hf_engine import HFEngine

    engine = HFEngine.from_path(str(model_dir), "float32", context_len=1024)
    cfg = EpisodeConfig(max_turns=guess_number.MAX_GUESSES, timeout_s=3600)
    runner = EpisodeRunner(guess_number.rollout, engine, engine.tokenizer, cfg, SamplingParams(max_tokens=16))
    problems = [Problem(f"p{j}", [{"role": "user", "content": guess_number.PROMPT}], 37 + j) for j in range(8)]
    runner.run(problems[:1], 2, seed=99)  # warm-up
    t = time.perf_counter()
    _groups, outcomes = runner.run(problems, episodes // len(problems), seed=0)
    gateway_s = time.perf_counter() - t
    calls = [turn.ids[:len(turn.ids) - last_sampled_run(turn.mask)] for per in outcomes for o in per
             for turn in o.episode.turns]
    sampled = sum(o.episode.sampled_tokens for per in outcomes for o in per)
    requests = [GenerationRequest(ids, 1, SamplingParams(max_tokens=16, seed=i)) for i, ids in enumerate(calls)]
    t = time.perf_counter()
    engine.generate_all(requests)
    direct_s = time.perf_counter() - t
    engine.close()
    return {"episodes": float(sum(map(len, outcomes))), "calls": float(len(calls)), "sampled_tokens": float(sampled),
            "gateway_s": gateway_s, "direct_s": direct_s}


def report_overhead(calls: int) -> tuple[float, float, float]:
    t = overhead(calls)
    diffs = [g - d for g, d in zip(t["openai"], t["direct"], strict=True)]
    gateway = [g - c - d for g, c, d in zip(t["openai"], t["client"], t["direct"], strict=True)]
    med, p99 = statistics.median(diffs) * 1e3, percentile(diffs, 0.99) * 1e3
    print(f"(2) gateway overhead per call, {len(diffs)} calls (turns 1..{TURNS} of episodes with ~300-token "
          "environment turns), scripted engine, server on the episodes' event loop:")
    for key, label in (("direct", "direct engine call"), ("openai", "openai client through the gateway"),
                       ("httpx", "plain httpx through the gateway"), ("client", "openai client alone (canned reply)")):
        print(f"    {label:36s} median {statistics.median(t[key]) * 1e3:7.2f} ms", flush=True)
    print(f"    overhead (openai - direct)           median {med:7.2f} ms   p99 {p99:7.2f} ms", flush=True)
    print(f"    the gateway's share (openai - client alone - direct): median {statistics.median(gateway) * 1e3:.2f} ms"
          f"   p99 {percentile(gateway, 0.99) * 1e3:.2f} ms   (target: median < 5 ms)", flush=True)
    return med, p99, statistics.median(gateway) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--parts", default="2,3",
                        help="which parts to run (1: tree packing, minutes; 2: overhead, 3: throughput)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.episodes, args.parts = TURNS, 8, "1,2,3"
    parts = set(args.parts.split(","))
    print(f"cpu: {cpu_description()}", flush=True)
    tree = ""
    if "1" in parts:
        from agent_packing import SMOKE, run_tree_packing  # bench/ is the script's folder

        print("(1) prefix-tree packing vs one sequence per call:", flush=True)
        r = run_tree_packing(tiny_model_folder(), **SMOKE) if args.smoke else run_tree_packing()
        tree = f"tree_step_speedup={r['tree_step_speedup']:.2f} tree_token_ratio={r['tree_token_ratio']:.2f} "
    else:
        print("(1) prefix-tree packing vs one sequence per call: not run (--parts 1,2,3 runs it)", flush=True)

    med = p99 = share = float("nan")
    if "2" in parts:
        med, p99, share = report_overhead(args.calls)
    if "3" not in parts:
        print(f"{tree}overhead_median_ms={med:.2f} overhead_p99_ms={p99:.2f} gateway_share_median_ms={share:.2f}")
        return

    with tempfile.TemporaryDirectory() as tmp:
        tp = throughput(args.episodes, write_tiny_model(Path(tmp) / "tiny"))
    print(f"(3) {tp['episodes']:.0f} concurrent guess_number episodes on the tiny model (hf engine): "
          f"{tp['calls']:.0f} calls, {tp['sampled_tokens']:.0f} sampled tokens in {tp['gateway_s']:.1f} s "
          f"= {tp['episodes'] / tp['gateway_s']:.2f} episodes/s, {tp['calls'] / tp['gateway_s']:.1f} calls/s, "
          f"{tp['sampled_tokens'] / tp['gateway_s']:.0f} tokens/s; the same calls made directly (all at once, "
          f"no turn-by-turn waiting): {tp['direct_s']:.1f} s")
    print(f"{tree}overhead_median_ms={med:.2f} overhead_p99_ms={p99:.2f} gateway_share_median_ms={share:.2f} "
          f"episodes_per_s={tp['episodes'] / tp['gateway_s']:.3f} "
          f"calls_per_s={tp['calls'] / tp['gateway_s']:.2f} direct_s={tp['direct_s']:.2f} gateway_s={tp['gateway_s']:.2f}")


if __name__ == "__main__":
    main()
