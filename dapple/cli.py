"""The ``dapple`` command line: a thin layer over the public API (profile, plan, simulate, show, demo)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

Adder = Callable[["argparse._SubParsersAction"], None]


def _add_show(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("show", help="print a Profile, Cluster or Plan YAML document, or summarise a trace JSON")
    p.add_argument("path", help="a dapple YAML document, or a Chrome-trace .json written by a traced pipeline")
    p.add_argument("--png", default=None, metavar="PNG",
                   help="draw the timeline (ranks x time) here: a trace's measured one, or a plan's simulated one")
    p.add_argument("--profile", default=None, help="plan --png: the profile it was made for (YAML or PipeDream .txt)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--cluster", default=None, help="plan --png: preset A, B or C, or a cluster YAML")
    p.add_argument("--overlap", action="store_true", help="plan --png: AllReduce overlapped with the last backward")
    p.add_argument("--json", default=None, metavar="JSON", help="plan: also write the simulated Chrome trace here")
    p.set_defaults(run=_run_show)


def _run_show(args: argparse.Namespace) -> int:
    import yaml

    from . import Cluster, Plan, Profile

    if str(args.path).endswith(".json"):
        return _show_trace(args.path, args.png)
    with open(args.path) as f:
        head = yaml.safe_load(f) or {}
    kinds = {"dapple_plan": Plan, "dapple_profile": Profile, "dapple_cluster": Cluster}
    for key, cls in kinds.items():
        if isinstance(head, dict) and key in head:
            doc = cls.load(args.path)
            print(doc)
            if key == "dapple_plan" and (args.png or args.json):
                return _show_simulated(doc, args)
            if args.png:
                raise SystemExit(f"dapple show: --png draws a trace (.json) or a plan; {args.path} is a "
                                 f"{key[7:]} document")
            return 0
    raise SystemExit(f"dapple show: {args.path} is not a dapple document (expected one of {sorted(kinds)})")


def _show_simulated(plan, args: argparse.Namespace) -> int:
    """Draw (and/or save as a Chrome trace) the simulated schedule of ``plan`` on its profile and cluster."""
    from .planner import draw_plan, simulate
    from .planner.gantt import device_labels
    from .planner.timeline import from_simulation, save_chrome_trace

    if not args.profile or not args.cluster:
        raise SystemExit(f"dapple show: drawing the simulated schedule of {args.path} needs the --profile it was "
                         f"made for and the --cluster it runs on")
    prof, cluster = _load_profile(args.profile, args.profile_batch), _load_cluster(args.cluster)
    if args.png:
        sim = draw_plan(plan, prof, cluster, args.png, overlap=args.overlap)
        print(f"{sim}\nwrote {args.png}")
    if args.json:
        sim = simulate(plan, prof, cluster, overlap=args.overlap)
        save_chrome_trace(from_simulation(sim), args.json, metadata={"simulated": True, "plan": plan.to_dict()},
                          process_names=device_labels(sim))
        print(f"wrote {args.json}")
    return 0


def _show_trace(path: str, png: str | None) -> int:
    from .planner.gantt import draw_gantt
    from .planner.timeline import from_chrome_trace, process_names, read_chrome_trace, summarize

    try:
        doc = read_chrome_trace(path)
        events = from_chrome_trace(doc, where=path)
    except ValueError as e:
        raise SystemExit(f"dapple show: {e}") from None
    if not events:
        raise SystemExit(f"dapple show: {path} holds no events")
    meta = doc.get("otherData") or {}
    names = process_names(doc)
    steps = meta.get("steps")
    head = f"trace {path}: {len(names) or len({e.rank for e in events})} rank(s), {len(events)} events"
    which = ""
    if steps:
        contiguous = steps == list(range(steps[0], steps[0] + len(steps)))
        which = (f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if contiguous
                 else f"steps {steps}")
    if meta.get("schedule"):
        head += (f", schedule {meta['schedule']}, {meta.get('num_micro_batches')} micro-batches x "
                 f"{meta.get('micro_batch_size')}, {which}")
    print(head + (f"; ms summed over the {len(steps)} steps" if steps and len(steps) > 1 else ""))
    print(f"{'rank':<28}{'step ms':>9}{'fwd ms':>9}{'bwd ms':>9}{'idle ms':>9}{'AR ms':>8}{'busy':>7}")
    for r, d in summarize(events).items():
        print(f"{names.get(r, f'rank {r}'):<28}{d['span_ms']:>9.1f}{d['forward_ms']:>9.1f}{d['backward_ms']:>9.1f}"
              f"{d['idle_ms']:>9.1f}{d['allreduce_ms']:>8.1f}{d['busy']:>7.0%}")
    if png:
        title = f"{path}: measured"
        if meta.get("schedule") and steps:
            stages = f"{meta['num_stages']} stage{'s' if meta['num_stages'] != 1 else ''}"
            title = (f"{meta['schedule']} schedule, measured: {stages}, "
                     f"M={meta['num_micro_batches']} micro-batches of {meta['micro_batch_size']} rows, {which}")
        draw_gantt(events, png, title=title, rank_labels=names)
        print(f"wrote {png}")
    return 0


def _parse_model_args(items: Sequence[str]) -> dict:
    """['n_layer=12', "norm='group'"] -> {'n_layer': 12, 'norm': 'group'} (Python literals, else strings)."""
    import ast

    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SystemExit(f"dapple: --model-arg expects KEY=VALUE with KEY a Python name, got {item!r}")
        try:
            kwargs[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value
    return kwargs


def load_example(spec: str, model_args: Sequence[str] = ()):
    """Call the factory named by ``spec`` ('pkg.module:factory' or 'file.py:factory') with ``model_args``.

    The result follows the convention of examples/models.py: ``.model``, ``.batch(n) -> (inputs, targets)``,
    ``.loss_fn``, optionally ``.name``, ``.leaf_modules``, ``.concrete_args``, ``.dynamic_shapes``.
    """
    import importlib
    import importlib.util
    import os

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"dapple: expected a model spec 'module:factory' (e.g. examples.models:gpt), got {spec!r}")
    if module_name.endswith(".py"):
        if not os.path.exists(module_name):
            raise SystemExit(f"dapple: {spec}: file {module_name} not found")
        name = "_dapple_spec_" + os.path.basename(module_name)[:-3]
        loader = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # dataclasses and pickling look their module up here
        loader.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:  # the console script does not see the current directory by itself
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise SystemExit(f"dapple: {spec}: cannot import {module_name} ({e}); run from the directory that "
                             "contains it or give a path/to/file.py:factory") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SystemExit(f"dapple: {spec}: {module_name} has no callable {attr!r}")
    try:
        example = factory(**_parse_model_args(model_args))
    except TypeError as e:
        raise SystemExit(f"dapple: {spec}: bad --model-arg for {attr}(): {e}") from e
    missing = [a for a in ("model", "batch", "loss_fn") if not hasattr(example, a)]
    if missing:
        raise SystemExit(f"dapple: {spec} returned {type(example).__name__} without {missing}; a factory returns an "
                         "object with .model, .batch(n) -> (inputs, targets) and .loss_fn (see examples/models.py)")
    return example


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
    p.add_argument("--tracer", choices=("auto", "fx", "export"), default="auto",
                   help="tracer: torch.fx, torch.export, or auto (fx, export where fx fails; default)")
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    import torch

    from . import profile

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ex = load_example(args.spec, args.model_arg)
    inputs, targets = ex.batch(max(args.batch_sizes))
    prof = profile(ex.model, inputs, ex.loss_fn, args.batch_sizes,
                   targets=targets if ex.loss_fn is not None else None, repeats=args.repeats, warmup=args.warmup,
                   device=args.device, concrete_args=getattr(ex, "concrete_args", None),
                   leaf_modules=getattr(ex, "leaf_modules", ()) or (), name=getattr(ex, "name", None) or None,
                   tracer=args.tracer, dynamic_shapes=getattr(ex, "dynamic_shapes", None))
    if not args.quiet:
        print(prof)
    if args.output:
        prof.save(args.output)
        print(f"wrote {args.output} ({prof.num_layers} layers, batch sizes {prof.batch_sizes}, "
              f"{prof.meta['profiling_seconds']:.1f} s)")
    return 0


def _load_profile(path: str, batch: int | None):
    from . import Profile

    if str(path).endswith(".txt"):  # a PipeDream graph.txt
        if batch is None:
            raise SystemExit(f"dapple: {path} is a PipeDream profile; give the batch size it was profiled at "
                             f"with --profile-batch")
        return Profile.from_pipedream(path, batch)
    return Profile.load(path)


def _load_cluster(spec: str):
    from . import Cluster

    if spec.upper() in ("A", "B", "C"):
        return Cluster.preset(spec)
    return Cluster.load(spec)


def _add_plan(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("plan", help="plan stages, replication and placement for a profile on a cluster")
    p.add_argument("profile", help="a dapple profile YAML, or a PipeDream graph.txt (with --profile-batch)")
    p.add_argument("--cluster", required=True, help="preset A, B or C (paper Table 3) or a cluster YAML")
    p.add_argument("--global-batch", type=int, required=True, help="samples per training iteration")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: searched)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--model", choices=("refined", "paper"), default="refined", help="latency model")
    p.add_argument("--overlap", action="store_true", help="the runtime overlaps AllReduce with the last backward")
    p.add_argument("--max-stages", type=int, default=None, help="limit the pipeline depth")
    p.add_argument("--schedule", choices=("dapple", "gpipe"), default="dapple")
    p.add_argument("-o", "--output", default=None, help="write the plan YAML here")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from .planner import plan

    prof = _load_profile(args.profile, args.profile_batch)
    result = plan(prof, _load_cluster(args.cluster), args.global_batch, args.micro_batch, model=args.model,
                  overlap=args.overlap, max_stages=args.max_stages, schedule=args.schedule)
    print(result)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _add_simulate(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("simulate", help="play a plan's iteration in the event simulator; compare with the estimate")
    p.add_argument("plan", help="a plan YAML")
    p.add_argument("--profile", required=True, help="the profile the plan was made for (YAML or PipeDream .txt)")
    p.add_argument("--profile-batch", type=int, default=None, help="batch size a PipeDream profile was taken at")
    p.add_argument("--cluster", required=True, help="preset A, B or C or a cluster YAML")
    p.add_argument("--overlap", action="store_true", help="overlap AllReduce with the last backward (DDP-style)")
    p.add_argument("--schedule", choices=("dapple", "gpipe"), default=None, help="default: the plan's")
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from . import Plan
    from .planner import evaluate, simulate

    plan = Plan.load(args.plan)
    prof = _load_profile(args.profile, args.profile_batch)
    cluster = _load_cluster(args.cluster)
    schedule = args.schedule or plan.schedule
    sim = simulate(plan, prof, cluster, overlap=args.overlap, schedule=schedule)
    print(sim)
    for model in ("refined", "paper"):
        est = evaluate(prof, cluster, plan.stages, plan.global_batch_size, plan.micro_batch_size, schedule=schedule,
                       warmup_policy=plan.warmup_policy, model=model, overlap=args.overlap).latency_ms
        print(f"  {model} model estimate: {est:.3f} ms ({(est - sim.latency_ms) / sim.latency_ms:+.1%} vs simulated "
              f"{sim.latency_ms:.3f} ms)")
    return 0


def _add_demo(sub: "argparse._SubParsersAction") -> None:
    from .demo import DemoConfig

    d = DemoConfig()
    p = sub.add_parser("demo", help="profile the built-in GPT, plan it for local processes, train it pipelined")
    p.add_argument("--nproc", type=int, default=d.nproc, help=f"local processes (default {d.nproc})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help=f"default {d.global_batch}")
    p.add_argument("--n-layer", type=int, default=d.n_layer, help=f"GPT blocks (default {d.n_layer})")
    p.add_argument("--n-embd", type=int, default=d.n_embd, help=f"GPT width (default {d.n_embd})")
    p.add_argument("--memory-fraction", type=float, default=d.memory_fraction,
                   help="device memory per process: this share of the parameters with Adam state, plus room for "
                        f"activations (default {d.memory_fraction}: the model does not fit one process)")
    p.add_argument("--trace", default=None, metavar="JSON", help="write a Chrome trace of the last step here")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run

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
    import os

    from . import Cluster
    from .profiler.bandwidth import DEFAULT_SIZES, measure, probe_local

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: every rank measures
        import torch
        import torch.distributed as dist

        from .runtime.distributed import init_distributed

        ctx = init_distributed(timeout=300.0)
        fits = measure(DEFAULT_SIZES, args.repeats)
        memory = args.device_memory
        if memory is None:
            memory = (torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else
                      os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / fits["devices_per_server"])
        if ctx.rank == 0:
            cluster = Cluster.from_probe(fits, device_memory=float(memory))
            cluster.save(args.output)
            print(f"{cluster}\nwrote {args.output}")
        dist.destroy_process_group()
        return 0
    fits = probe_local(args.nproc, DEFAULT_SIZES, args.repeats)
    memory = args.device_memory or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / args.nproc
    cluster = Cluster.from_probe(fits, device_memory=float(memory))
    cluster.name = "local"
    cluster.save(args.output)
    print(f"{cluster}\nwrote {args.output}")
    return 0


COMMANDS: list[Adder] = [_add_show, _add_profile, _add_plan, _add_simulate, _add_probe, _add_demo]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapple", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
