"""End-to-end generation benchmark: our target-only and speculative generation beside transformers' generate.

    python scripts/bench_generate.py                       # H200: bf16, Llama-3.2-1B shapes, k = 4, batch 1, 8, 32
    python scripts/bench_generate.py --device cpu --quick  # a tiny configuration that runs anywhere
    python scripts/bench_generate.py --json out.json

Models (random weights, the same in every path): the target has Llama-3.2-1B's shapes (hidden 2048, 16 layers,
32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings); the draft is the target's first
``--draft-layers`` layers with its embedding, final norm and head (no copy). Random weights give no realistic
acceptance by themselves, so the target's later layers are damped: their attention and MLP output projections are
scaled by a factor s. s is calibrated per batch size, on the very requests that are timed: bisection on the
acceptance of the compiled speculative generator's own run of them (256 tokens each; the CUDA graphs read
the weights in place, so a new s needs no recompile), to the s whose acceptance is closest to ``--alpha`` (default
0.75) from above. Greedy generation with random weights falls into repeated tokens at rates that depend on the
prompt (one calibration shared by all batch sizes, on 8 other prompts at 0.80, gave 0.96 on the batch-1 prompt),
so only a calibration on the measured requests keeps every batch's alpha in the realistic 0.5 to 0.9, which each
row checks. The target still computes every layer at full cost; only the numbers change. The target-only run of a
batch uses the same s.

When the models package provides `load_model` (Hugging Face checkpoints), the weights are made by transformers'
`LlamaForCausalLM`, damped there, saved and loaded by `load_model`, so transformers' `generate` (target-only, and
with ``assistant_model`` = its own first layers, k constant) runs on the same weights at batch 1. Otherwise the
transformers rows are skipped.

A batch size is its number of slots. By default as many requests as slots run, one wave: the run lasts as long
as its slowest request, and rows whose requests finished idle (the table's row occupancy). With
``--requests-per-slot R``, R times as many requests queue and continuous batching admits one into each slot that
frees up, the steady state of a server; the target-only run gets the same queue.

Per batch size, each path is warmed up (rounds compiled and captured, prefill graphs captured, then one short
untimed generate of the same prompts, which JIT-compiles the admission's eager kernels at these shapes) and then
timed over one generate call of all the batch's requests, admissions included (with several --read-every values, one
call per value, on the same graphs). Reported: tokens/s of each path; alpha (accepted / tested drafts); c = draft
step time / target step time, where the draft step is the propose part of a round divided by k and the target step
is one target-only round (each timed as its own captured graph, CUDA events); the measured speedup (speculative /
target-only tokens/s); Leviathan et al.'s prediction (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); efficiency =
measured / predicted, printed as the product of an acceptance factor (the measured tokens per round over those that
independent acceptance at alpha gives: acceptance that is not independent from draft to draft lowers it) and a cost
factor (the rest: a round's cost, idle rows, admissions and host time included, against k draft steps plus one
target step); the host share: the part of the speculative run's wall time in which no round group ran on the
device, split into the admissions (their CUDA-event spans: prefills, first tokens, state writes) and the rest
(between groups, outside admissions); and the device's wait for the host: the share of wall time in which the
device ran neither a round group nor an admission whose work the host had all queued before the device reached it
(such an admission's span is device work alone: prefills the target-only path runs too; the first admission of a
call finds the device idle and counts whole, so the figure errs high). With --full-split the target and
verification parts of a round are timed too (two more compiles per batch size), against the target-only round:
Leviathan's formula takes the verify forward to cost one target step. Requests are greedy by default (verified by
greedy_verify); with --temperature T they sample at T (request i's seed is i; target-only samples too) and
speculation verifies by rejection sampling, whose acceptance is a coin per draft (sum of min(p, q)) rather than
greedy's all-or-nothing match of a repeating continuation; --method block verifies by block verification instead,
and --top-k / --top-p / --min-p add the sampling filters to every request (the generator is then built with
sampling_filters, for both paths). The JSON (and the table on stderr) is rewritten after every batch size.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec_ops.runtime.generator import Generator, GeneratorConfig, Request  # noqa: E402

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                intermediate_size=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
QUICK = dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256,
             rope_theta=10000.0, rms_norm_eps=1e-5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes, batch 1 and 2, 16 + 24 tokens")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--draft-layers", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--alpha", type=float, default=0.75,
                   help="the acceptance (of the timed requests' own speculative run) to calibrate to, per batch")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy requests verified by greedy_verify; > 0: every request samples at this "
                        "temperature (seed = its index) and speculation verifies by rejection sampling (or --method "
                        "block)")
    p.add_argument("--method", choices=("auto", "rejection", "block"), default="auto",
                   help="verification with --temperature > 0 (auto: rejection sampling)")
    p.add_argument("--top-k", type=int, default=0, help="every request's top_k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="every request's min_p (0 = off)")
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="requests per batch slot (default 1: one wave of `batch` requests; more: a queue that "
                        "continuous batching admits into the slots that finish, the steady state of a server)")
    p.add_argument("--read-every", default="2",
                   help="rounds between host reads (GeneratorConfig.read_every); a comma-separated list times each "
                        "value with the same compiled graphs and calibration, one row each (default 2, the "
                        "generator's)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--full-split", nargs="?", const="all", default=None,
                   help="also time the target and verification parts (at these comma-separated batch sizes, or all)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the rounds (default: on CUDA only)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write JSON to this file ('-': stdout)")
    p.add_argument("--timed-after", default=None, metavar="FILE",
                   help="before each timed section, wait until FILE exists (a job sharing the machine, such as a "
                        "test run, is then over; compiling may overlap it)")
    args = p.parse_args(argv)
    if args.k < 1:
        p.error("--k must be >= 1")
    if args.requests_per_slot < 1:
        p.error("--requests-per-slot must be >= 1")
    try:
        args.read_every = [int(v) for v in args.read_every.split(",")]
    except ValueError:
        p.error(f"--read-every must be comma-separated integers, got {args.read_every!r}")
    if min(args.read_every) < 1:
        p.error("--read-every values must be >= 1")
    if not 0 < args.alpha < 1:
        p.error("--alpha must lie in (0, 1)")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        p.error(f"--temperature must be finite and >= 0, got {args.temperature}")
    if args.method != "auto" and args.temperature == 0:
        p.error("--method rejection or block needs --temperature > 0")
    if args.top_k < 0:
        p.error(f"--top-k must be an integer >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must lie in (0, 1] (1 = off), got {args.top_p}")
    if not 0 <= args.min_p <= 1:
        p.error(f"--min-p must lie in [0, 1] (0 = off), got {args.min_p}")
    if filters_on(args) and args.temperature == 0:
        p.error("--top-k, --top-p and --min-p need --temperature > 0")
    return args


def filters_on(args) -> bool:
    return (args.top_k, args.top_p, args.min_p) != (0, 1.0, 0.0)


# --- models -------------------------------------------------------------------------------------------------


def _models_api():
    try:
        from specdec_ops.models import LlamaConfig, LlamaModel, load_model  # noqa: F401
    except ImportError:
        return None
    return load_model


def _damped_modules(layers, keep: int):
    """The output projections of layers past `keep` (what damping scales), for our model or transformers'."""
    weights = []
    for layer in list(layers)[keep:]:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn")
        mlp_down = layer.mlp.down_proj if hasattr(layer, "mlp") else layer.down_proj
        weights += [attn.o_proj.weight, mlp_down.weight]
    return weights


MAX_SCALE = 8.0 ** 5


class Damping:
    """The output projections of the target's layers past the draft's (or transformers' copy of them), scaled
    together by s from their original values, in place."""

    def __init__(self, weights: list[torch.Tensor]):
        self.weights = weights
        self.originals = [w.detach().clone() for w in weights]
        self.scale = 1.0

    @torch.no_grad()
    def set(self, scale: float) -> None:
        for w, o in zip(self.weights, self.originals):
            w.copy_(o * scale)
        self.scale = scale


def calibrate(damping: Damping, measure, alpha: float, steps: int = 8) -> tuple[float, float]:
    """Sets `damping` to the s in (0, MAX_SCALE] whose measured acceptance measure() is closest to alpha from
    above (bisection; acceptance grows as s shrinks: s < 1 damps the later layers, s > 1 strengthens them). Random
    later layers can matter so little that s must grow by orders of magnitude: the upper end of the bracket grows
    by 8x until the acceptance falls below alpha. Returns (s, its acceptance)."""

    def set_scale(scale):
        damping.set(scale)
        return measure()

    low, high = (1.0, 8.0) if set_scale(1.0) >= alpha else (0.0, 1.0)
    while high < MAX_SCALE and set_scale(high) >= alpha:
        low, high = high, high * 8.0
    if set_scale(high) >= alpha:
        return high, set_scale(high)
    for _ in range(steps):
        mid = (low + high) / 2 if low < 1.0 else (low * high) ** 0.5  # geometric above 1
        if set_scale(mid) >= alpha:
            low = mid
        else:
            high = mid
    return low, set_scale(low)


def build_models(args, shapes: dict, dtype: torch.dtype, device: str, workdir: Path):
    """(target, draft, hf_target or None, hf_draft or None, the target's Damping, transformers' or None)."""
    load_model = _models_api()
    hf = hf_draft = None
    if load_model is not None and not args.no_hf:
        import transformers

        hf_config = transformers.LlamaConfig(
            vocab_size=shapes["vocab_size"], hidden_size=shapes["hidden_size"],
            num_hidden_layers=shapes["num_layers"], num_attention_heads=shapes["num_heads"],
            num_key_value_heads=shapes["num_kv_heads"], intermediate_size=shapes["intermediate_size"],
            rope_theta=shapes["rope_theta"], rms_norm_eps=shapes["rms_norm_eps"], tie_word_embeddings=True,
            # The context the runs need at least (the Generator refuses a max_model_len past it).
            max_position_embeddings=max(4096, _max_model_len(args)), torch_dtype=dtype)
        torch.manual_seed(0)
        with torch.device(device):  # initialized where it runs (a 1.2B model's CPU init takes long)
            hf = transformers.LlamaForCausalLM(hf_config).to(dtype=dtype).eval()
        # Our models' initialization (weights randn / sqrt(fan_in), embedding randn): transformers' std-0.02 init
        # leaves every layer's update small beside the embedding, so greedy text hardly depends on the layers.
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.dim() == 2:
                    fan_in = 1 if "embed" in name else p.shape[1]
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) / fan_in ** 0.5)
        draft_config = transformers.LlamaConfig(**{**hf_config.to_dict(), "num_hidden_layers": args.draft_layers})
        with torch.device(device):
            hf_draft = transformers.LlamaForCausalLM(draft_config).to(dtype=dtype).eval()
        hf_draft.load_state_dict({k: v for k, v in hf.state_dict().items() if k in hf_draft.state_dict()})
        path = workdir / "target"
        hf.save_pretrained(path)
        target = load_model(path, dtype=dtype, device=device)
        draft = target.truncated(args.draft_layers)
    else:
        try:
            from specdec_ops.models import LlamaConfig as Config, LlamaModel as Model
            config = Config(**shapes, tie_word_embeddings=True, dtype=dtype)
        except ImportError:
            from specdec_ops.models import DraftModel as Model, DraftModelConfig as Config
            config = Config(**shapes, dtype=dtype)
        target = Model(config, device=device, seed=0)
        if hasattr(target, "truncated"):
            draft = target.truncated(args.draft_layers)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from support import prefix_draft

            draft = prefix_draft(target, args.draft_layers)
    hf_damping = Damping(_damped_modules(hf.model.layers, args.draft_layers)) if hf is not None else None
    return target, draft, hf, hf_draft, Damping(_damped_modules(target.layers, args.draft_layers)), hf_damping


# --- runs ---------------------------------------------------------------------------------------------------


def _max_model_len(args) -> int:
    """Positions per request: the prompt, the new tokens and a round's k + 1, rounded up to a 16-slot block."""
    return -(-(args.prompt_len + args.new_tokens + args.k + 1) // 16) * 16


def our_run(target, draft, args, batch: int, prompts, device: str, compile: bool, damping: Damping,
            hf_damping: Damping | None):
    """Calibrates the damping on this batch's requests, then times target-only and speculative generation."""
    k = args.k
    max_model_len = _max_model_len(args)
    method = "greedy" if args.temperature == 0 else ("rejection" if args.method == "auto" else args.method)
    config = GeneratorConfig(num_speculative_tokens=k, method=method, max_num_reqs=batch,
                             max_model_len=max_model_len, block_size=16, batch_sizes=(batch,),
                             read_every=args.read_every[0],
                             sampling_filters=filters_on(args))
    requests = [Request(p, args.new_tokens, temperature=args.temperature, seed=i, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p)
                for i, p in enumerate(prompts[:batch * args.requests_per_slot])]
    full_split = args.full_split == "all" or (args.full_split and str(batch) in args.full_split.split(","))
    t0 = time.perf_counter()
    spec = Generator(target, draft, config, device=device, compile=compile)
    spec.warm_up()
    scale, acceptance = calibrate(damping, lambda: spec.generate(requests).metrics.acceptance_rate, args.alpha)
    if hf_damping is not None:  # the same damping on transformers' copy: the same bf16 products
        hf_damping.set(scale)
    calibration = dict(damping=scale, calibration_acceptance=acceptance, calibration_s=time.perf_counter() - t0)
    print(f"  [{time.strftime('%H:%M:%S')}] batch {batch}: damping s = {scale:.4f}, acceptance {acceptance:.3f} "
          f"({calibration['calibration_s']:.1f} s with the compile)", file=sys.stderr, flush=True)
    results = dict(calibration=calibration, timed={})
    for name, model_draft in (("plain", None), ("spec", draft)):
        t0 = time.perf_counter()
        generator = spec if model_draft is not None else Generator(target, None, config, device=device,
                                                                     compile=compile)
        generator.warm_up()
        wait_for(args.timed_after)
        # The target and verification parts are timed only with --full-split (each is one more compile per size).
        split = generator.measure_split(batch, repeats=5 if device == "cuda" else 2,
                                        parts=("draft", "target", "verify") if full_split else ("draft",))
        generator.generate([dataclasses.replace(r, max_new_tokens=8)
                            for r in requests])  # untimed: JIT of the admission's kernels
        warm = time.perf_counter() - t0
        results[name] = dict(split=split, warm_up_s=warm)
        for read_every in args.read_every:  # a host-loop setting: the same graphs serve every value
            generator.config = dataclasses.replace(config, read_every=read_every)
            out = generator.generate(requests)
            results["timed"].setdefault(read_every, {})[name] = out
            print(f"  [{time.strftime('%H:%M:%S')}] batch {batch} {name}, read_every {read_every}: "
                  f"{out.metrics.tokens_per_s:.1f} tokens/s (warm-up {warm:.1f} s)", file=sys.stderr, flush=True)
        del generator
    return results


def spec_method(args) -> str:
    if args.temperature == 0:
        return "greedy"
    name = "block verification" if args.method == "block" else "rejection sampling"
    filters = f", top_k {args.top_k}, top_p {args.top_p:g}, min_p {args.min_p:g}" if filters_on(args) else ""
    return f"{name}, temperature {args.temperature:g}{filters}"


def wait_for(path: str | None) -> None:
    while path is not None and not Path(path).exists():
        time.sleep(0.5)


@torch.no_grad()
def hf_run(hf, hf_draft, prompt, args, device: str, mode: str) -> float:
    """tokens/s of transformers' generate at batch 1 (greedy, or sampling at --temperature)."""
    ids = torch.tensor([prompt], device=device)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p or None) if args.temperature > 0 else dict(do_sample=False)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0, **sampling)
    if mode == "static":
        kwargs["cache_implementation"] = "static"
    if mode == "assisted":
        hf_draft.generation_config.num_assistant_tokens = args.k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        hf_draft.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = hf_draft
    hf.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm up
    wait_for(args.timed_after)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf.generate(ids, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_generate: no CUDA device; use --device cpu --quick", file=sys.stderr)
        return 2
    shapes = QUICK if args.quick else LLAMA_1B
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.new_tokens = args.new_tokens or (24 if args.quick else 256)
    args.draft_layers = args.draft_layers or (1 if args.quick else 2)
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,8,32")).split(",")]
    compile = args.compile if args.compile is not None else device.startswith("cuda")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        target, draft, hf, hf_draft, damping, hf_damping = build_models(args, shapes, dtype, device, Path(workdir))
    print(f"models ready in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shapes["vocab_size"], (args.prompt_len,), generator=gen).tolist()
               for _ in range(max(batches) * args.requests_per_slot)]
    rows, k = [], args.k
    for batch in batches:
        result = our_run(target, draft, args, batch, prompts, device, compile, damping, hf_damping)
        for read_every, outs in result["timed"].items():
            rows.append(make_row(args, batch, read_every, result, outs))
        row = rows[-1]
        if batch == 1 and hf is not None:
            for mode in ("dynamic", "static", "assisted"):
                try:
                    row[f"hf_{mode}_tokens_per_s"] = hf_run(hf, hf_draft, prompts[0], args, device, mode)
                except Exception as error:  # a transformers version without this path: report, keep going
                    row[f"hf_{mode}_tokens_per_s"] = None
                    row[f"hf_{mode}_error"] = f"{type(error).__name__}: {error}"[:200]
        document = dict(device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                        torch=torch.__version__, dtype=str(dtype), shapes=shapes, k=k, prompt_len=args.prompt_len,
                        new_tokens=args.new_tokens, draft_layers=args.draft_layers, calibration_alpha=args.alpha,
                        method=rows[-1]["method"], temperature=args.temperature,
                        requests_per_slot=args.requests_per_slot,
                        compile=compile, rows=rows,
                        total_s=time.perf_counter() - started)
        print(markdown(document), file=sys.stderr, flush=True)  # what is done so far survives a time limit
        if args.json and args.json != "-":
            Path(args.json).write_text(json.dumps(document, indent=2))
    print(markdown(document))
    if args.json == "-":
        print(json.dumps(document, indent=2))
    return 0


def make_row(args, batch: int, read_every: int, result: dict, outs: dict) -> dict:
    """One table row: the target-only and speculative runs of a batch size at one read_every."""
    k = args.k
    plain, spec = outs["plain"].metrics, outs["spec"].metrics
    alpha = spec.acceptance_rate
    c = result["spec"]["split"]["draft"] / k / result["plain"]["split"]["round"]
    # Tokens per round that independent acceptance at rate alpha gives; the formula is that over (k c + 1).
    iid_emitted = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    predicted = iid_emitted / (k * c + 1)
    measured = spec.tokens_per_s / plain.tokens_per_s
    # efficiency = acceptance_factor * cost_factor: how far the measured tokens per round fall short of
    # independent acceptance at alpha, and how far a round's cost (idle rows, admissions and host time included)
    # exceeds k draft steps plus one target step.
    emitted = spec.mean_emitted_per_round
    acceptance_factor = emitted / iid_emitted if emitted else None
    cost_factor = measured * (k * c + 1) / emitted if emitted else None
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs["spec"].requests, outs["plain"].requests))
    num_requests = batch * args.requests_per_slot
    return dict(batch=batch, requests=num_requests, read_every=read_every, method=spec_method(args),
                **result["calibration"],
                plain_tokens_per_s=plain.tokens_per_s, spec_tokens_per_s=spec.tokens_per_s,
                alpha=alpha, alpha_realistic=alpha is not None and 0.5 <= alpha <= 0.9,
                acceptance_per_position=spec.acceptance_per_position, rounds=spec.rounds,
                plain_rounds=plain.rounds, admission_share=spec.admission_share,
                # live rows per round / batch: below 1 where requests that finished early leave rows idle
                occupancy=spec.row_rounds / (spec.rounds * batch) if spec.rounds else 0.0,
                plain_admission_share=plain.admission_share, spec_wall_s=spec.wall_s, plain_wall_s=plain.wall_s,
                mean_emitted_per_round=spec.mean_emitted_per_round, c=c, speedup=measured,
                predicted_speedup=predicted, efficiency=measured / predicted,
                acceptance_factor=acceptance_factor, cost_factor=cost_factor, host_share=spec.host_share,
                plain_host_share=plain.host_share, split_ms=result["spec"]["split"],
                # the device waiting for the host: neither a round group nor an admission queued ahead of it ran
                device_wait_share=spec.device_wait_share, plain_device_wait_share=plain.device_wait_share,
                # host time inside the round groups' launches / wall: near the rounds' device share when the
                # launches block (the host then cannot run ahead of the device)
                launch_share=spec.launch_s / spec.wall_s if spec.wall_s else 0.0,
                plain_round_ms=result["plain"]["split"]["round"],
                identical_requests=f"{same}/{num_requests}" if args.temperature == 0 else "-",
                warm_up_s=result["spec"]["warm_up_s"] + result["plain"]["warm_up_s"])


def markdown(doc) -> str:
    def f(value, pattern="{:.1f}"):
        return "-" if value is None else pattern.format(value)

    def ratio(ours, theirs):
        return "-" if not theirs else f"{ours / theirs:.1f}x"

    lines = [f"## bench_generate: {doc['device']}, torch {doc['torch']}, {doc['dtype']}, k = {doc['k']}, "
             f"prompt {doc['prompt_len']}, {doc['new_tokens']} new tokens, draft = target's first "
             f"{doc['draft_layers']} layers, {doc.get('method', 'greedy')} (the target's later layers damped by s, "
             f"calibrated per batch on the timed requests to an acceptance >= {doc['calibration_alpha']}; "
             "transformers' columns: batch 1, on the batch's last row)", "",
             "| batch (requests, read_every) | target-only tok/s | speculative tok/s | alpha (in 0.5-0.9) | "
             "mean emitted | c | speedup | predicted | efficiency | host share (admissions + waiting) | "
             "device waiting for the host (speculative / target-only) | "
             "target-only host share | greedy identical | HF target-only tok/s (dynamic / static) | "
             "HF assisted tok/s | spec vs HF fastest target-only / assisted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        fastest = max([v for v in (r.get("hf_dynamic_tokens_per_s"), r.get("hf_static_tokens_per_s")) if v],
                      default=None)
        lines.append(
            f"| {r['batch']} ({r['requests']}, {r.get('read_every', '-')}) | {f(r['plain_tokens_per_s'])} | "
            f"{f(r['spec_tokens_per_s'])} | "
            f"{f(r['alpha'], '{:.3f}')} ({'yes' if r['alpha_realistic'] else 'no'}) "
            f"| {f(r['mean_emitted_per_round'], '{:.2f}')} | {f(r['c'], '{:.3f}')} | {f(r['speedup'], '{:.2f}x')} | "
            f"{f(r['predicted_speedup'], '{:.2f}x')} | {f(r['efficiency'], '{:.2f}')} | "
            f"{f(r['host_share'], '{:.1%}')} ({f(r['admission_share'], '{:.1%}')} + "
            f"{f(r['host_share'] - r['admission_share'], '{:.1%}')}) | "
            f"{f(r.get('device_wait_share'), '{:.1%}')} / {f(r.get('plain_device_wait_share'), '{:.1%}')} | "
            f"{f(r['plain_host_share'], '{:.1%}')} | "
            f"{r['identical_requests']} | "
            f"{f(r.get('hf_dynamic_tokens_per_s'))} / {f(r.get('hf_static_tokens_per_s'))} | "
            f"{f(r.get('hf_assisted_tokens_per_s'))} | {ratio(r['spec_tokens_per_s'], fastest)} / "
            f"{ratio(r['spec_tokens_per_s'], r.get('hf_assisted_tokens_per_s'))} |")
    lines.append("")
    lines.append("split per round (ms; each part is its own compiled graph, timed over 5 replays by CUDA events, "
                 "by the wall clock on CPU): " + "; ".join(
        f"batch {r['batch']}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in r["split_ms"].items())
        + f", target-only round {r['plain_round_ms']:.3f}" for r in doc["rows"]))
    lines.append("rounds (speculative / target-only) and wall s: " + "; ".join(
        f"batch {r['batch']}: {r['rounds']} / {r['plain_rounds']} rounds, {r['spec_wall_s']:.3f} / "
        f"{r['plain_wall_s']:.3f} s, speculative row occupancy {r['occupancy']:.2f}, damping s = {r['damping']:.4g}, "
        f"host time in round launches {f(r.get('launch_share'), '{:.1%}')} of wall"
        for r in doc["rows"]))
    lines.append("efficiency = acceptance factor (mean emitted / the tokens per round of independent acceptance at "
                 "alpha) x cost factor (speedup x (k c + 1) / mean emitted): " + "; ".join(
        f"batch {r['batch']}: {r['efficiency']:.2f} = {f(r.get('acceptance_factor'), '{:.3f}')} x "
        f"{f(r.get('cost_factor'), '{:.3f}')}"
        for r in doc["rows"]))
    lines.append(f"total {doc['total_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
