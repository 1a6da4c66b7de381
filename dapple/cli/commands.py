"""The ``dapple`` subcommands profile, plan, simulate, probe and demo: each an argparse adder and its runner."""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist

from .. import Cluster, Plan, profile
from ..core.cluster import ram_per_process
from ..core.plan import MIXED_PRECISIONS
from ..core.schedule import SCHEDULES
from ..planner import evaluate, plan, simulate
from ..profiler.probe.links import DEFAULT_SIZES, measure, probe_local
from ..runtime.distributed import init_distributed
from .demo import DemoConfig, run
from .inputs import load_cluster, load_example, load_profile, plan_inputs

Adder = Callable[["argparse._SubParsersAction"], None]


def _add_profile(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("profile", help="measure a model's layers (times, sizes) into a Profile YAML")
    p.add_argument("spec", help="model factory 'module:factory' or 'file.py:factory' (see examples/models.py)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8], metavar="B", help="default: 4 8")
    p.add_argument("-o", "--output", help="write the Profile YAML here")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory, e.g. n_layer=12 (repeatable)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per layer (median; default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per layer first (default 3)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before profiling")
    p.add_argument("--quiet", action="store_true", help="do not print the profile")
    p.add_argument("--selective", action="store_true",
                   help="also measure selective recomputation (for dapple plan --recompute selective)")
    p.add_argument("--tracer", choices=("auto", "fx", "export"), default="auto",
                   help="tracer: torch.fx, torch.export, or auto (fx, export where fx fails; default)")
    p.add_argument("--layers", nargs="+", default=None, metavar="PATH",
                   help="module paths that each become a layer (e.g. embed blocks.0 blocks.1 head), instead of the "
                        "default: every block of the model's stacks of repeated blocks, at any depth, and the "
                        "modules beside them (also a factory's .layers)")
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ex = load_example(args.spec, args.model_arg)
    inputs, targets = ex.batch(max(args.batch_sizes))
    prof = profile(ex.model, inputs, ex.loss_fn, args.batch_sizes,
                   targets=targets if ex.loss_fn is not None else None, repeats=args.repeats, warmup=args.warmup,
                   device=args.device, concrete_args=getattr(ex, "concrete_args", None),
                   leaf_modules=getattr(ex, "leaf_modules", ()) or (), name=getattr(ex, "name", None) or None,
                   tracer=args.tracer, dynamic_shapes=getattr(ex, "dynamic_shapes", None),
                   layers=args.layers or getattr(ex, "layers", None), selective=args.selective)
    if not args.quiet:
        print(prof)
    if args.output:
        prof.save(args.output)
        print(f"wrote {args.output} ({prof.num_layers} layers, batch sizes {prof.batch_sizes}, "
              f"{prof.meta['profiling_seconds']:.1f} s)")
    return 0


def _add_plan(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("plan", help="plan stages, replication and placement for a profile on a cluster")
    p.add_argument("profile", help="a dapple profile YAML, or a PipeDream graph.txt (with --profile-batch)")
    p.add_argument("--cluster", required=True, help="preset A, B or C (paper Table 3) or a cluster YAML")
    p.add_argument("--global-batch", type=int, required=True, help="samples per training iteration")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: searched)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--model", choices=("refined", "paper"), default="refined",
                   help="latency model (the paper's planner: --model paper --no-overlap)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="AllReduce overlapped with the last backward, as dapple's runtime runs every plan (default); "
                        "--no-overlap: formula 2's assumption")
    p.add_argument("--max-stages", type=int, default=None, help="limit the pipeline depth")
    p.add_argument("--schedule", choices=(*SCHEDULES, "auto"), default="dapple",
                   help="auto: dapple or zb-h1 (zero bubble), whichever the simulator finds faster for the plan")
    p.add_argument("--search", choices=("auto", "full", "compact"), default="auto",
                   help="placements searched (auto: full up to 4 servers, compact above)")
    p.add_argument("--time-limit", type=_seconds, default="auto",
                   help="stop the search after this many seconds (inf: never; default auto: 60 s for the compact "
                        "search of clusters over 4 servers, no limit for the full search)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="stop proving once the plan is within this fraction of the best possible (e.g. 0.01)")
    p.add_argument("--workers", type=_workers, default="auto",
                   help="processes searching micro-batch sizes side by side (default auto: one per core for the "
                        "compact search and for a full search whose seeds took 0.1 s, Linux only)")
    p.add_argument("--recompute", choices=tuple(RECOMPUTE), default="off",
                   help="activation recomputation: off; on (every stage, whole), layers (every stage, layer by "
                        "layer), selective (every stage, matmuls kept: a profile made with --selective); or auto "
                        "(whole stages, only where memory binds: where a stage's K_i would have to drop without it, "
                        "if that is faster)")
    p.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default=None,
                   help="plan for a job run under autocast in this dtype (activations take half the bytes); the "
                        "plan records it and dapple.pipeline runs it so")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="plan for each stage's optimizer state sharded over its replicas (ZeRO-1: train with "
                        "dapple.shard_optimizer); a stage on r replicas holds 1/r of it")
    p.add_argument("-o", "--output", default=None, help="write the plan YAML here")
    p.set_defaults(run=_run_plan)


RECOMPUTE = {"off": False, "on": True, "layers": "layers", "selective": "selective", "auto": "auto"}  # -> dapple.plan


def _run_plan(args: argparse.Namespace) -> int:
    prof = load_profile(args.profile, args.profile_batch)
    result = plan(prof, load_cluster(args.cluster), args.global_batch, args.micro_batch, model=args.model,
                  overlap=args.overlap, max_stages=args.max_stages, schedule=args.schedule, search=args.search,
                  time_limit=args.time_limit, gap=args.gap, workers=args.workers,
                  recompute=RECOMPUTE[args.recompute], mixed_precision=args.mixed_precision,
                  shard_optimizer=args.shard_optimizer)
    print(result)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _or_auto(parse: Callable[[str], object], expected: str) -> Callable[[str], object]:
    """An argparse type: ``auto``, or what ``parse`` makes of the text (else the error says ``expected``)."""
    def convert(text: str) -> object:
        if text == "auto":
            return text
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected} or auto, got {text!r}") from None
    return convert


_seconds = _or_auto(float, "seconds, inf")  # --time-limit (inf: none)
_workers = _or_auto(int, "a number of processes")  # --workers


def _add_simulate(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("simulate", help="play a plan's iteration in the event simulator; compare with the estimate")
    p.add_argument("plan", help="a plan YAML")
    p.add_argument("--profile", default=None, help="the profile to play it on (YAML or PipeDream .txt; default: the "
                                                    "one `dapple plan -o` recorded in the plan)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--cluster", default=None, help="preset A, B or C or a cluster YAML (default: the cluster the "
                                                    "plan was made for, recorded in it)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap AllReduce with the last backward (DDP-style); default: as the plan was made")
    p.add_argument("--schedule", choices=SCHEDULES, default=None, help="default: the plan's")
    p.add_argument("--link-sharing", choices=("held", "shared"), default=None,
                   help="a transfer holds its links whole, or shares them max-min fairly (default: the cluster's)")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    prof, cluster = plan_inputs(plan, args.plan, args.profile, args.profile_batch, args.cluster, "simulate")
    schedule = args.schedule or plan.schedule
    sim = simulate(plan, prof, cluster, overlap=args.overlap, schedule=schedule, link_sharing=args.link_sharing)
    print(sim)
    chunked = plan.chunks.chunks > 1  # formula 2 prices one stage per device group: not a plan of chunks
    for model in ("refined",) if chunked else ("refined", "paper"):  # the plan's sizes, policy and overlap
        est = evaluate(prof, cluster, plan, schedule=schedule, model=model, overlap=args.overlap).latency_ms
        print(f"  {model} model estimate: {est:.3f} ms ({(est - sim.latency_ms) / sim.latency_ms:+.1%} vs simulated "
              f"{sim.latency_ms:.3f} ms)")
    return 0


def _add_demo(sub: "argparse._SubParsersAction") -> None:
    d = DemoConfig()
    p = sub.add_parser("demo", help="profile the built-in GPT, plan it for local processes, train it pipelined")
    p.add_argument("--nproc", type=int, default=d.nproc, help=f"local processes (default {d.nproc})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help=f"default {d.global_batch}")
    p.add_argument("--n-layer", type=int, default=d.n_layer, help=f"GPT blocks (default {d.n_layer})")
    p.add_argument("--n-embd", type=int, default=d.n_embd, help=f"GPT width (default {d.n_embd})")
    p.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                   help="device memory per process: this share of what one process needs for the whole model "
                        "(parameters with Adam state and one row's activations; below 1 the model is split into "
                        f"stages; default {d.memory_fraction})")
    p.add_argument("--trace", default=None, metavar="JSON", help="write a Chrome trace of the last step here")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    run(DemoConfig(nproc=args.nproc, steps=args.steps, global_batch=args.global_batch, n_layer=args.n_layer,
                   n_embd=args.n_embd, memory_fraction=args.memory_fraction, trace=args.trace))
    return 0


def _add_probe(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("probe", help="measure link and AllReduce bandwidth/latency into a Cluster YAML "
                                     "(under torchrun: the real cluster; else --nproc local processes)")
    p.add_argument("-o", "--output", default="cluster.yaml", help="Cluster YAML to write (default cluster.yaml)")
    p.add_argument("--nproc", type=int, default=2, help="local processes when not under torchrun (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="timed transfers per size (median; default 7)")
    p.add_argument("--device-memory", type=float, default=None,
                   help="bytes per device (default: the GPU's memory, or RAM / processes per server)")
    p.set_defaults(run=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: every rank measures the real cluster
        return _probe_launched(args)
    fits = probe_local(args.nproc, DEFAULT_SIZES, args.repeats)
    memory = args.device_memory or ram_per_process(args.nproc)
    cluster = Cluster.from_probe(fits, device_memory=float(memory))
    cluster.name = "local"
    cluster.save(args.output)
    print(f"{cluster}\nwrote {args.output}")
    return 0


def _probe_launched(args: argparse.Namespace) -> int:
    ctx = init_distributed(timeout=300.0)
    fits = measure(DEFAULT_SIZES, args.repeats)
    memory = args.device_memory
    if memory is None:
        memory = (torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else
                  ram_per_process(fits["devices_per_server"]))
    if ctx.rank == 0:
        cluster = Cluster.from_probe(fits, device_memory=float(memory))
        cluster.save(args.output)
        print(f"{cluster}\nwrote {args.output}")
    dist.destroy_process_group()
    return 0


COMMANDS: list[Adder] = [_add_profile, _add_plan, _add_simulate, _add_probe, _add_demo]
