"""Notebook-style tour of the planner: profile a model here, plan it for a GPU cluster you do not have.

    PYTHONPATH=$PWD python examples/plan_for_a_cluster.py          # writes docs/plan_gpt_A.png, docs/plan_bert48_A.png

1. profile the built-in GPT on this machine (dapple.profile), 2. plan it for the paper's config A (2 servers
x 8 V100, NVLink inside, 25 Gbps between), 3. print the plan, 4. draw its simulated schedule. Then the same
for BERT-48 from a real V100 profile (PipeDream's graph.txt format, shipped with the paper's planner).
"""

from __future__ import annotations

from pathlib import Path

import dapple
from dapple.models import GPT, lm_loss, random_tokens

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    cluster = dapple.Cluster.preset("A")

    model = GPT(n_layer=8, n_embd=128, n_head=4, vocab_size=512, block_size=64)
    x, y = random_tokens(8, 64, 512)
    prof = dapple.profile(model, x, lm_loss, batch_sizes=(4, 8), targets=y, repeats=3)  # times on THIS machine
    plan = dapple.plan(prof, cluster, global_batch_size=256)
    print(plan)
    dapple.planner.draw_plan(plan, prof, cluster, docs / "plan_gpt_A.png")

    bert = dapple.Profile.from_pipedream(ROOT / "profiles" / "pipedream" / "bert_48.txt", batch_size=2)
    plan = dapple.plan(bert, cluster, global_batch_size=64)
    print(plan)
    sim = dapple.planner.draw_plan(plan, bert, cluster, docs / "plan_bert48_A.png")
    print(f"{sim}\nwrote {docs / 'plan_gpt_A.png'} and {docs / 'plan_bert48_A.png'}")


if __name__ == "__main__":
    main()
