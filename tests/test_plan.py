"""A Plan records the chain it was made for (``info["chain_sha256"]``, the
chain's digest), and ``Plan.check_chain`` tells another chain: an edited or
re-profiled chain replayed an old plan whose numbers no longer held."""

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest

from rtmem.planners import (Chain, ChainMismatchWarning, Plan, Platform, compare_remat,
                            plan_floating, plan_remat, plan_revolve, plan_sequential,
                            plan_sqrt, plan_store_all, simulate)


def _random_chain(rng, n: int) -> Chain:
    x = rng.integers(1, 1000, n)
    return Chain(u_f=rng.uniform(0.5, 2, n), u_b=rng.uniform(0.5, 2, n), x=x,
                 xbar=x + rng.integers(0, 1000, n), w=rng.integers(0, 100, n),
                 x0=int(rng.integers(1, 1000)), name="random")


def test_every_planner_records_the_digest_of_its_chain(tmp_path):
    rng = np.random.default_rng()
    chain = _random_chain(rng, 7)
    homogeneous = Chain.homogeneous(7, x=int(rng.integers(1, 1000)))
    budget = plan_store_all(chain, math.inf).peak       # finite: plan_floating needs one
    plans = {"store_all": plan_store_all(chain, budget),
             "sequential": plan_sequential(chain, budget),
             "sqrt": plan_sqrt(chain, budget),
             "rotor": plan_remat(chain, budget, slots=50),
             "floating": plan_floating(chain, budget, slots=50)}
    for name, plan in compare_remat(chain, budget, slots=50).items():
        if isinstance(plan, Plan):      # (an InfeasibleError for a planner that cannot)
            plans[f"compare:{name}"] = plan
    for name, plan in plans.items():
        assert plan.info["chain_sha256"] == chain.digest(), name
        assert plan.check_chain(chain) is True, name
        # the saved file keeps it, and the plan reads back equal
        plan.save(tmp_path / "plan.json")
        again = Plan.load(tmp_path / "plan.json")
        assert again == plan and again.check_chain(chain) is True, name
    revolve = plan_revolve(homogeneous, math.inf)
    assert revolve.check_chain(homogeneous) is True
    with pytest.warns(ChainMismatchWarning):
        assert revolve.check_chain(chain) is False


def test_chain_digest_tells_every_number_and_ignores_the_name(tmp_path):
    rng = np.random.default_rng()
    chain = _random_chain(rng, 5)
    digest = chain.digest()
    assert len(digest) == 64 and int(digest, 16) >= 0
    chain.save(tmp_path / "chain.json")
    assert Chain.load(tmp_path / "chain.json").digest() == digest
    assert dataclasses.replace(chain, name="renamed").digest() == digest
    i = int(rng.integers(0, 5))
    for field in ("u_f", "u_b", "x", "xbar", "w", "o_f", "o_b"):
        values = getattr(chain, field).copy()
        values[i] += 1
        changed = {field: values}
        if field == "x":                  # xbar >= x stage by stage
            changed["xbar"] = chain.xbar + 1
        assert dataclasses.replace(chain, **changed).digest() != digest, field
    for field, value in (("x0", chain.x0 + 1), ("u_loss", 0.5), ("o_loss", 3),
                         ("no_recompute", np.arange(5) == i)):
        assert dataclasses.replace(chain, **{field: value}).digest() != digest, field


def test_check_chain_warns_for_an_edited_chain():
    rng = np.random.default_rng()
    chain = _random_chain(rng, 6)
    plan = plan_remat(chain, math.inf, slots=50)
    # one stage's forward time edited: the sizes (and so the peak) are unchanged,
    # which the peak alone could not tell; the makespan is not the plan's
    u_f = chain.u_f.copy()
    u_f[int(rng.integers(0, 6))] += 1.0
    edited = dataclasses.replace(chain, u_f=u_f, name="edited")
    assert simulate(edited, plan.schedule, Platform(math.inf)).makespan != plan.makespan
    with pytest.warns(ChainMismatchWarning) as caught:
        assert plan.check_chain(edited) is False
    message = str(caught[0].message)
    assert "another chain" in message and "'edited' (6 stages)" in message
    assert f"{plan.peak:,} bytes" in message and "plan again" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.check_chain(dataclasses.replace(chain, name="renamed")) is True
    with pytest.raises(TypeError, match="chain must be a Chain"):
        plan.check_chain(plan.schedule)


def test_plan_files_without_the_digest_still_load():
    rng = np.random.default_rng()
    chain = _random_chain(rng, 4)
    doc = plan_remat(chain, math.inf, slots=50).to_dict()
    del doc["info"]["chain_sha256"]
    old = Plan.from_json(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert old.check_chain(chain) is None
    # a hand-built plan records nothing either
    bare = Plan(schedule=old.schedule, makespan=old.makespan, peak=old.peak,
                budget=math.inf, algorithm="hand")
    assert bare.check_chain(chain) is None
