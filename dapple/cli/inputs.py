"""What the CLI reads: model factories named 'module:factory', profiles (YAML or PipeDream) and clusters."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Sequence

from .. import Cluster, Profile


def _parse_model_args(items: Sequence[str]) -> dict:
    """['n_layer=12', "norm='group'"] -> {'n_layer': 12, 'norm': 'group'} (Python literals, else strings)."""
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
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"dapple: expected a model spec 'module:factory' (e.g. examples.models:gpt), got {spec!r}")
    if module_name.endswith(".py"):
        if not os.path.exists(module_name):
            raise SystemExit(f"dapple: {spec}: file {module_name} not found")
        name = "_dapple_spec_" + os.path.basename(module_name)[:-3]
        loader = importlib.util.spec_from_file_location(name, module_name)
        if loader is None or loader.loader is None:
            raise SystemExit(f"dapple: {spec}: cannot load {module_name} as a Python module")
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


def load_profile(path: str, batch: int | None):
    if str(path).endswith(".txt"):  # a PipeDream graph.txt
        if batch is None:
            raise SystemExit(f"dapple: {path} is a PipeDream profile; give the batch size it was profiled at "
                             f"with --profile-batch")
        return Profile.from_pipedream(path, batch)
    return Profile.load(path)


def load_cluster(spec: str):
    if spec.upper() in ("A", "B", "C"):
        return Cluster.preset(spec)
    if not Path(spec).is_file():
        raise SystemExit(f"dapple: --cluster {spec!r}: expected a preset A, B or C (paper Table 3) or a cluster "
                         f"YAML file (dapple probe writes one); no such file")
    return Cluster.load(spec)


def plan_inputs(plan, plan_path: str, profile: str | None, profile_batch: int | None, cluster: str | None,
                command: str):
    """The (Profile, Cluster) to play ``plan`` on: the ones given (``--profile``, ``--cluster``), else the ones
    the plan records in its meta (``dapple.plan`` and ``pipedream_plan``: ``cluster_spec``, the whole Cluster
    document; ``profile_file`` and ``profile_batch``, ``Profile.source()``, for a profile loaded or saved)."""
    meta = plan.meta
    if profile is None:
        profile = meta.get("profile_file")
        if not profile:
            raise SystemExit(f"dapple {command}: {plan_path} does not record the profile it was made for "
                             f"(meta.profile_file: a plan of a profile made in memory, not loaded or saved); give "
                             f"--profile")
        beside = Path(plan_path).parent / Path(profile).name  # the two moved together (copied to another machine)
        if not Path(profile).is_file():
            if not beside.is_file():
                raise SystemExit(f"dapple {command}: {plan_path} was made from the profile {profile}, which is not "
                                 f"there nor beside the plan ({beside}); give --profile")
            profile = str(beside)
        if profile_batch is None:
            profile_batch = meta.get("profile_batch")
        print(f"profile {profile} (from {plan_path})")
    if cluster is not None:
        return load_profile(profile, profile_batch), load_cluster(cluster)
    spec = meta.get("cluster_spec")
    if not isinstance(spec, dict):
        raise SystemExit(f"dapple {command}: {plan_path} does not record the cluster it was planned for "
                         f"(meta.cluster_spec, which dapple.plan writes); give --cluster")
    try:
        found = Cluster.from_dict(spec, where=f"{plan_path} meta.cluster_spec")
    except ValueError as e:  # (a DocumentError too)
        raise SystemExit(f"dapple {command}: {e}; give --cluster") from None
    print(f"cluster {found.name or ''} {found.servers} x {found.devices_per_server} (from {plan_path})")
    return load_profile(profile, profile_batch), found
