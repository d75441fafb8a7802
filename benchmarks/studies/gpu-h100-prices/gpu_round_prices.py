"""What a speculative round costs on a GPU, for the default pair's architectures, at batch 1.

Whether an adaptive draft length pays depends on prices: what a drafted token costs next to a
target step (c), and what a verify pass over k + 1 positions costs
(`../specdecpp-price-sweep/specdecpp_price_sweep.py` replays the recorded rounds at any such
prices). A forward pass's time depends on the shapes, not on the weights' values, so this
builds the target and drafter from their `config.json` files alone, with random weights on the
GPU (the weights themselves need not travel), and times:

- the target's forward over n = 1..13 new positions after a cached context, and the drafter's
  one-token step (the bench's own `calibrate` timer, which waits for the device);
- whole speculative rounds of constant k with the engine (the parts of
  `../round-cost-parts/round_cost_parts.py`: the target's forward, the rule, the rest of the
  verify step, drafting), so the engine's own per-round work is priced in target steps as
  well. The random models' text is meaningless; only the time of each part per round is read.

    python benchmarks/studies/gpu-h100-prices/gpu_round_prices.py TARGET_CONFIG DRAFT_CONFIG
        [--dtype bfloat16] [--context 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel
from specdecode.bench.runner import machine_info
from specdecode.core.prices import pass_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "round-cost-parts"))
from round_cost_parts import instrument, measure, print_parts

LONGEST = 12


def rewind(cache, length: int) -> None:
    """Set a static cache's write position back to `length`: each pass rewrites one slot range."""
    for layer in cache.layers:
        if isinstance(layer.cumulative_length, torch.Tensor):
            layer.cumulative_length.fill_(length)
        else:
            layer.cumulative_length = length


def graph_step_seconds(model, context: list[int], counts: list[int], reps: int = 20) -> dict:
    """Median time of a forward over n new positions replayed as a captured CUDA graph.

    What an engine that captured its passes (a static cache, fixed shapes) would pay: the
    host's kernel launches leave the step, which is then bound by reading the weights. The
    passes rewrite the same cache slots each time; only their time is read."""
    from transformers import StaticCache

    length = len(context)
    cache = StaticCache(config=model.config, max_cache_len=length + max(counts))
    ids = torch.tensor([context], device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache)
        seconds = {}
        for n in counts:
            inputs = dict(
                input_ids=ids[:, -n:].clone(),
                position_ids=torch.arange(length, length + n, device="cuda")[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=n,
            )
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    rewind(cache, length)
                    model(**inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            rewind(cache, length)
            with torch.cuda.graph(graph):
                model(**inputs)
            times = []
            for _ in range(reps):
                rewind(cache, length)
                torch.cuda.synchronize()
                start = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds[n] = statistics.median(times)
            del graph
    return seconds


def random_model(config_path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(Path(config_path).parent)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target_config")
    parser.add_argument("draft_config")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=256, help="cached tokens before a pass")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument(
        "--graphs", action="store_true", help="also price passes replayed as CUDA graphs"
    )
    parser.add_argument("--no-rounds", action="store_true", help="skip the engine's rounds")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("this prices a GPU: no CUDA device found")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    target = random_model(args.target_config, dtype, args.device)
    drafter = random_model(args.draft_config, dtype, args.device)
    vocab = min(target.config.vocab_size, drafter.config.vocab_size)
    context = torch.randint(100, vocab - 1000, (args.context,)).tolist()
    counts = list(range(1, LONGEST + 2))
    for _ in range(2):  # the first call of each shape pays for the kernels' set-up
        jobs = [(CachedModel(target), counts), (CachedModel(drafter), [1])]
        seconds, drafted = pass_seconds(jobs, context, reps=9)
        draft = drafted[1]
    step = seconds[1]
    curve = [seconds[k + 1] / step for k in range(1, LONGEST + 1)]
    print(f"{machine_info().get('cuda')}, {args.dtype}, context {args.context}, batch 1")
    c = draft / step
    print(f"target step {1000 * step:.2f} ms, drafter step {1000 * draft:.2f} ms, c = {c:.3f}")
    print("verify pass of k drafted tokens, in target steps:")
    print(" ".join(f"{k}:{v:.3f}" for k, v in enumerate(curve, 1)))

    graphs = {}
    if args.graphs:
        try:
            g = graph_step_seconds(target, context, counts)
            g_draft = graph_step_seconds(drafter, context, [1])[1]
            graphs = {
                "target_step_s": g[1],
                "drafter_step_s": g_draft,
                "c": g_draft / g[1],
                "verify_curve": [g[k + 1] / g[1] for k in range(1, LONGEST + 1)],
            }
            print(
                f"captured graphs: target step {1000 * g[1]:.3f} ms, drafter step "
                f"{1000 * g_draft:.3f} ms, c = {graphs['c']:.3f}; verify pass in steps:"
            )
            print(" ".join(f"{k}:{v:.3f}" for k, v in enumerate(graphs["verify_curve"], 1)))
        except Exception as error:  # report what a capture refused, then go on
            graphs = {"error": f"{type(error).__name__}: {error}"}
            print(f"captured graphs failed: {graphs['error']}")
    parts = []
    if not args.no_rounds:
        parts = engine_rounds(target, drafter, vocab, args)
    if args.json:
        record = {
            "machine": machine_info(),
            "dtype": args.dtype,
            "context": args.context,
            "target_step_s": step,
            "drafter_step_s": draft,
            "c": draft / step,
            "verify_curve": curve,
            "graphs": graphs,
            "round_parts": parts,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def engine_rounds(target, drafter, vocab: int, args) -> list[dict]:
    """Constant-k rounds of the engine on the random models, split into parts."""
    decoder = SpeculativeDecoder(target, drafter=drafter)
    instrument(decoder, torch.cuda.synchronize if args.device == "cuda" else lambda: None)
    prompts = [
        torch.randint(100, vocab - 1000, (args.context,)).tolist() for _ in range(args.prompts)
    ]
    print(f"\nengine rounds: {args.prompts} random prompts, {args.tokens} tokens, T = 0.7, coupled")
    return print_parts(measure(decoder, prompts, args.tokens, ks=(1, 2, 4, 6, 8)))


if __name__ == "__main__":
    main()
