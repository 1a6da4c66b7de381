"""`dapple plan` and `dapple simulate` on a PipeDream profile and a saved cluster document."""

from __future__ import annotations

import pytest

import dapple
from dapple import Cluster, Plan, Profile, simulate
from dapple.cli import main
from tests.conftest import pipedream_path


def test_plan_then_simulate(tmp_path, capsys):
    profile = str(pipedream_path("xlnet_36"))
    out = tmp_path / "plan.yaml"
    assert main(["plan", profile, "--profile-batch", "1", "--cluster", "A", "--global-batch", "128",
                 "--no-overlap", "-o", str(out)]) == 0  # (the paper's assumption: overlapped, xlnet_36 is DP)
    text = capsys.readouterr().out
    assert "dapple plan: 2 stage(s) on 16 device(s)" in text and "estimate (refined model)" in text
    plan = Plan.load(out)
    assert [s.replicas for s in plan.stages] == [8, 8]  # paper Table VII: 8:8, one stage per server
    assert plan.layer_names[0] == "node1:Input" and plan.estimate is not None
    assert plan == Plan.from_dict(plan.to_dict())  # estimate, details and meta survive YAML
    cluster_file = tmp_path / "a.yaml"
    Cluster.preset("A").save(cluster_file)
    assert main(["simulate", str(out), "--profile", profile, "--profile-batch", "1",
                 "--cluster", str(cluster_file)]) == 0
    text = capsys.readouterr().out
    assert "simulated dapple iteration" in text and "refined model estimate" in text and "paper model estimate" in text
    assert "sharing links" not in text
    assert main(["simulate", str(out), "--profile", profile, "--profile-batch", "1", "--cluster", "A",
                 "--link-sharing", "shared"]) == 0
    assert "transfers sharing links" in capsys.readouterr().out


def test_simulate_follows_the_overlap_the_plan_was_made_with(tmp_path, capsys):
    profile = str(pipedream_path("bert_48"))
    out = tmp_path / "plan.yaml"
    assert main(["plan", profile, "--profile-batch", "2", "--cluster", "A", "--global-batch", "64", "--overlap",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    args = ["simulate", str(out), "--profile", profile, "--profile-batch", "2", "--cluster", "A"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "AllReduce overlapped with the last backward" in text
    assert f"refined model estimate: {plan.estimate.latency_ms:.3f} ms" in text  # the plan's own estimate
    assert main([*args, "--no-overlap"]) == 0
    assert "AllReduce overlapped" not in capsys.readouterr().out
    prof = Profile.from_pipedream(profile, 2)  # the API does the same: simulate() follows plan.meta["overlap"]
    assert simulate(plan, prof, Cluster.preset("A")).overlap is True
    assert simulate(plan, prof, Cluster.preset("A"), overlap=False).overlap is False


def simulated_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("simulated dapple iteration"))


def test_simulate_plays_the_plan_on_the_profile_and_cluster_it_records(tmp_path, capsys):
    """`dapple simulate plan.yaml` alone (the issue's command): the plan records its profile file and batch
    (`dapple plan -o`) and its whole cluster (dapple.plan), here one that no preset names."""
    profile = str(pipedream_path("bert_48"))
    slow = Cluster.preset("A").to_dict() | {"inter_bandwidth": 1e9, "name": "slow"}
    cluster_file, out = tmp_path / "slow.yaml", tmp_path / "sub" / "plan.yaml"
    Cluster.from_dict(slow).save(cluster_file)
    out.parent.mkdir()
    assert main(["plan", profile, "--profile-batch", "2", "--cluster", str(cluster_file), "--global-batch", "64",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.meta["cluster_spec"] == Cluster.load(cluster_file).to_dict()
    assert plan.meta["profile_file"] == str(pipedream_path("bert_48").resolve()) and plan.meta["profile_batch"] == 2
    capsys.readouterr()
    assert main(["simulate", str(out), "--profile", profile, "--profile-batch", "2",
                 "--cluster", str(cluster_file)]) == 0
    given = simulated_line(capsys.readouterr().out)
    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert simulated_line(text) == given and f"profile {plan.meta['profile_file']} (from {out})" in text
    assert "cluster slow 2 x 8 (from" in text
    assert main(["simulate", str(out), "--cluster", "A"]) == 0  # a flag overrides what the plan records
    assert simulated_line(capsys.readouterr().out) != given  # 25 Gbps instead of 8 Gbps between the servers


def test_a_notebook_plan_of_a_loaded_profile_simulates_from_the_command_line(tmp_path, capsys):
    """dapple.plan records where its profile was loaded from or saved to (Profile.path): a plan made in a notebook
    and saved there needs no flags either."""
    from tests.planner.helpers import linear_profile

    prof = linear_profile([1.0, 2.0, 1.0])
    assert prof.source() == {}
    prof.save(tmp_path / "p.yaml")  # saving gives it a file
    assert prof.source() == {"profile_file": str((tmp_path / "p.yaml").resolve())}
    made = dapple.plan(prof, Cluster.preset("A"), 16)
    assert made.meta["profile_file"] == str((tmp_path / "p.yaml").resolve()) and "profile_batch" not in made.meta
    made.save(tmp_path / "plan.yaml")
    capsys.readouterr()
    assert main(["simulate", str(tmp_path / "plan.yaml")]) == 0
    assert "simulated dapple iteration" in capsys.readouterr().out
    loaded = Profile.load(tmp_path / "p.yaml")  # loading too
    assert loaded.path == made.meta["profile_file"] and loaded == prof


def test_plan_and_simulate_a_plan_of_chunks(tmp_path, capsys):
    """`dapple plan --schedule auto` may return two chunks per device group; `dapple simulate` prices it with the
    refined model only (formula 2 knows one stage per device group)."""
    from tests.planner.helpers import cluster, linear_profile

    linear_profile([1.0] * 8, params=2e9, boundary=1e3, saved=1e5).save(tmp_path / "p.yaml")
    cluster(1, 4, intra=1e10).save(tmp_path / "c.yaml")
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(tmp_path / "p.yaml"), "--cluster", str(tmp_path / "c.yaml"), "--global-batch", "32",
                 "--micro-batch", "4", "--schedule", "auto", "--workers", "1", "-o", str(out)]) == 0
    assert Plan.load(out).chunks.chunks == 2 and "simulated, not searched" in capsys.readouterr().out
    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "simulated zb-v iteration" in text and "refined model estimate" in text and "paper" not in text


def test_a_plan_moved_with_its_profile_finds_it_beside_itself(tmp_path, capsys):
    """Plan and profile copied together elsewhere (another machine): the recorded path is gone, the file beside
    the plan is used."""
    from tests.planner.helpers import linear_profile

    made, there = tmp_path / "made", tmp_path / "there"
    made.mkdir()
    linear_profile([1.0, 2.0, 1.0]).save(made / "p.yaml")
    assert main(["plan", str(made / "p.yaml"), "--cluster", "A", "--global-batch", "16", "-o",
                 str(made / "plan.yaml")]) == 0
    made.rename(there)
    capsys.readouterr()
    assert main(["simulate", str(there / "plan.yaml")]) == 0
    assert f"profile {there / 'p.yaml'} (from {there / 'plan.yaml'})" in capsys.readouterr().out


def test_simulate_says_which_input_the_plan_does_not_record(tmp_path):
    profile = str(pipedream_path("bert_48"))
    out = tmp_path / "plan.yaml"
    assert main(["plan", profile, "--profile-batch", "2", "--cluster", "A", "--global-batch", "64",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    in_memory = Profile.from_dict(Profile.from_pipedream(profile, 2).to_dict())  # no file: nothing to record
    assert in_memory.path is None and in_memory.source() == {}
    dapple.plan(in_memory, Cluster.preset("A"), 64, 8).save(tmp_path / "bare.yaml")
    with pytest.raises(SystemExit, match=r"bare.yaml does not record the profile it was made for \(meta.profile_file: "
                                         r"a plan of a profile made in memory, not loaded or saved\); give --profile"):
        main(["simulate", str(tmp_path / "bare.yaml")])
    assert main(["simulate", str(tmp_path / "bare.yaml"), "--profile", profile, "--profile-batch", "2"]) == 0
    moved = Plan.from_dict(plan.to_dict())
    moved.meta["profile_file"] = str(tmp_path / "gone.txt")
    moved.save(tmp_path / "moved.yaml")
    with pytest.raises(SystemExit, match=r"made from the profile .*gone.txt, which is not there nor beside the plan "
                                         r"\(.*gone.txt\); give --profile"):
        main(["simulate", str(tmp_path / "moved.yaml")])
    old = Plan.from_dict(plan.to_dict())
    del old.meta["cluster_spec"]  # a plan written before plans recorded their cluster
    old.save(tmp_path / "old.yaml")
    with pytest.raises(SystemExit, match=r"old.yaml does not record the cluster it was planned for .* --cluster"):
        main(["simulate", str(tmp_path / "old.yaml")])
    broken = Plan.from_dict(plan.to_dict())
    broken.meta["cluster_spec"]["servers"] = 0
    broken.save(tmp_path / "broken.yaml")
    with pytest.raises(SystemExit, match=r"broken.yaml meta.cluster_spec.*servers.*0.*give --cluster"):
        main(["simulate", str(tmp_path / "broken.yaml")])
    other = Profile.from_pipedream(profile, 2)
    other.layers[5].name = "renamed"  # the same count of layers, another model
    other.save(tmp_path / "other.yaml")
    with pytest.raises(SystemExit, match=r"plan.layer_names differs from the profile of bert_48's layers at index 5: "
                                         r"the plan has 'node6:.*', the profile of bert_48 has 'renamed'"):
        main(["simulate", str(out), "--profile", str(tmp_path / "other.yaml")])


def tiny_plan_args(tmp_path) -> tuple[list, object]:
    """`dapple plan` of a 3-layer profile on preset A, and the plan file it writes."""
    from tests.planner.helpers import linear_profile
    profile, out = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    linear_profile([1.0, 2.0, 1.0]).save(profile)
    return ["plan", str(profile), "--cluster", "A", "--global-batch", "16", "-o", str(out)], out


def test_time_limit_takes_seconds_inf_or_auto(tmp_path, capsys):
    args, out = tiny_plan_args(tmp_path)
    with pytest.raises(SystemExit):
        main([*args, "--time-limit", "abc"])
    assert "--time-limit: expected seconds, inf or auto, got 'abc'" in capsys.readouterr().err
    assert main(args) == 0 and Plan.load(out).meta["time_limit_s"] is None  # auto: the full search has none
    assert main([*args, "--time-limit", "inf"]) == 0 and Plan.load(out).meta["time_limit_s"] == float("inf")
    assert main([*args, "--time-limit", "5"]) == 0 and Plan.load(out).meta["time_limit_s"] == 5.0


def test_workers_take_a_count_or_auto(tmp_path, capsys):
    args, out = tiny_plan_args(tmp_path)
    with pytest.raises(SystemExit):
        main([*args, "--workers", "many"])
    assert "--workers: expected a number of processes or auto, got 'many'" in capsys.readouterr().err
    assert main(args) == 0 and Plan.load(out).meta["workers"] == 1  # auto: the full search runs in-process
    assert main([*args, "--workers", "1"]) == 0 and Plan.load(out).meta["workers"] == 1


def test_pipedream_profile_needs_its_batch_size():
    with pytest.raises(SystemExit, match="vgg19.txt is a PipeDream profile; .* --profile-batch"):
        main(["plan", str(pipedream_path("vgg19")), "--cluster", "A", "--global-batch", "64"])


def test_show_plan_draws_the_simulated_schedule(tmp_path, capsys):
    profile = str(pipedream_path("bert_48"))
    out = tmp_path / "plan.yaml"
    assert main(["plan", profile, "--profile-batch", "2", "--cluster", "A", "--global-batch", "64",
                 "-o", str(out)]) == 0
    png, js = tmp_path / "sim.png", tmp_path / "sim.json"
    assert main(["show", str(out), "--png", str(png), "--json", str(js)]) == 0  # the plan's recorded inputs
    assert png.read_bytes()[:4] == b"\x89PNG" and "simulated dapple iteration" in capsys.readouterr().out
    from dapple.core.timeline import load_chrome_trace
    events = load_chrome_trace(js)
    plan = Plan.load(out)
    assert {e.rank for e in events} == set(range(plan.num_devices))
    m = plan.num_micro_batches
    for d in range(plan.num_devices):  # each device runs every forward and backward once
        names = sorted(e.name for e in events if e.rank == d and e.kind in ("forward", "backward"))
        assert names == sorted([f"F{j}" for j in range(m)] + [f"B{j}" for j in range(m)])


def test_plan_search_options(capsys):
    assert main(["plan", str(pipedream_path("bert_48")), "--profile-batch", "2", "--cluster", "A",
                 "--global-batch", "64", "--micro-batch", "8", "--search", "compact", "--gap", "0.02",
                 "--time-limit", "30"]) == 0
    text = capsys.readouterr().out
    assert "compact search" in text and "optimality gap 2.0%" in text
    assert "no plan on all 16 devices is modelled below" in text  # preset A


def test_bad_input_ends_with_the_message_not_a_traceback(tmp_path, monkeypatch):
    from ..planner.helpers import linear_profile

    profile = tmp_path / "p.yaml"
    linear_profile([1.0, 2.0]).save(profile)
    base = ["plan", str(profile), "--global-batch", "64"]
    with pytest.raises(SystemExit, match=r"--cluster 'Z': expected a preset A, B or C .* or a cluster YAML"):
        main(base + ["--cluster", "Z"])
    with pytest.raises(SystemExit, match=r"^dapple plan: max_stages: expected a positive integer, got 0$"):
        main(base + ["--cluster", "A", "--max-stages", "0"])
    monkeypatch.setenv("DAPPLE_DEBUG", "1")  # the traceback, for a bug report
    with pytest.raises(ValueError, match="max_stages"):
        main(base + ["--cluster", "A", "--max-stages", "0"])


def test_version_and_help_name_the_distribution(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"dapple {dapple.__version__} (dapple-pipeline)"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "pip install dapple-pipeline" in capsys.readouterr().out
    import importlib.metadata
    assert importlib.metadata.metadata("dapple-pipeline")["Name"] == "dapple-pipeline"


def test_plan_recompute_and_mixed_precision_flags(tmp_path, capsys):
    from tests.planner.helpers import cluster, linear_profile
    linear_profile([1.0] * 4, params=1e8, boundary=1e6, saved=1e8).save(tmp_path / "prof.yaml")
    cluster(1, 2, memory=3e9).save(tmp_path / "c.yaml")
    base = ["plan", str(tmp_path / "prof.yaml"), "--cluster", str(tmp_path / "c.yaml"), "--global-batch", "32",
            "--micro-batch", "8"]
    assert main([*base, "--recompute", "auto", "--mixed-precision", "bf16", "-o", str(tmp_path / "p.yaml")]) == 0
    assert "mixed precision bf16" in capsys.readouterr().out
    plan = Plan.load(tmp_path / "p.yaml")
    assert plan.mixed_precision == "bf16" and plan.meta["recompute"] == "auto"
    assert main([*base, "--recompute", "on", "-o", str(tmp_path / "on.yaml")]) == 0
    assert "recompute" in capsys.readouterr().out  # the table's column
    assert all(s.recompute for s in Plan.load(tmp_path / "on.yaml").stages)
    assert main([*base, "-o", str(tmp_path / "off.yaml")]) == 0
    off = Plan.load(tmp_path / "off.yaml")
    assert off.mixed_precision is None and not any(s.recompute for s in off.stages)
    with pytest.raises(SystemExit):
        main([*base, "--recompute", "maybe"])


def test_plan_overlaps_the_allreduce_unless_told_not_to(tmp_path, capsys):
    """`dapple plan` plans for the runtime (AllReduce overlapped with the last backward); --no-overlap (with
    --model paper: the paper's planner) plans with formula 2's assumption."""
    profile = str(pipedream_path("bert_48"))
    for flags, overlap in (([], True), (["--no-overlap"], False), (["--model", "paper", "--no-overlap"], False)):
        out = tmp_path / "plan.yaml"
        assert main(["plan", profile, "--profile-batch", "2", "--cluster", "A", "--global-batch", "64", *flags,
                     "-o", str(out)]) == 0
        assert Plan.load(out).meta["overlap"] is overlap, flags
        capsys.readouterr()


def test_plan_shard_optimizer(tmp_path, capsys):
    from tests.planner.helpers import cluster, linear_profile
    prof, cl = tmp_path / "p.yaml", tmp_path / "c.yaml"
    linear_profile([1.0] * 4, params=[1e9, 1e6, 1e6, 1e6], saved=1e5).save(prof)  # fits only sharded
    cluster(1, 4, memory=3.2e9).save(cl)
    out = tmp_path / "plan.yaml"
    args = ["plan", str(prof), "--cluster", str(cl), "--global-batch", "16", "--micro-batch", "4", "--workers", "1"]
    assert main(args + ["--shard-optimizer", "-o", str(out)]) == 0
    assert "optimizer state sharded over each stage's replicas" in capsys.readouterr().out
    assert Plan.load(out).shard_optimizer is True
    with pytest.raises((SystemExit, ValueError), match="shard_optimizer=True"):
        main(args)
