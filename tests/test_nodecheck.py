"""The node check's judge on figures as trainstack.node_check writes them: a slow node named with its ratio, a
missing report, missing GPUs, ECC errors, the site's floors and a slow link (two slow neighbour pairs)."""

from __future__ import annotations

from trainstack._slurm.nodecheck import THRESHOLDS, judge


def node(gflops: float, **extra):
    return {"gflops": [gflops], "gpus_visible": extra.pop("gpus_visible", 0), "gpus": extra.pop("gpus", []),
            "mem_available_gb": 100.0, "shm_free_gb": 50.0, "write_mbps": 500.0, **extra}


def test_a_node_far_below_the_others_is_named_with_its_figure():
    named = judge({"a": node(40), "b": node(42), "c": node(12)}, None, 0, THRESHOLDS)
    assert list(named) == ["c"] and "12.0 GFLOP/s, 0.29x the median" in named["c"]
    assert judge({"a": node(40), "b": node(30)}, None, 0, THRESHOLDS) == {}  # 0.75x: within the ratio


def test_missing_reports_gpus_ecc_and_site_floors():
    named = judge({"a": None, "b": node(40, gpus_visible=3), "c": node(40, gpus_visible=4, gpus=[
        {"index": 1.0, "ecc.errors.uncorrected.volatile.total": 2.0}]), "d": node(40, gpus_visible=4)},
        None, 4, {**THRESHOLDS, "min_write_mbps": 600.0})
    assert "did not report" in named["a"] and "3 GPU(s) visible, 4 requested" in named["b"]
    assert "uncorrected ECC errors on GPU 1" in named["c"] and "job folder writes 500.0 MB/s" in named["d"]
    assert "below the site's min_gflops = 50" in judge({"a": node(40)}, None, 0, {**THRESHOLDS,
                                                                                     "min_gflops": 50.0})["a"]


def test_a_slow_link_is_bisected_to_the_node_in_two_slow_pairs():
    pairs = [{"hosts": ["a", "b"], "seconds": 0.01}, {"hosts": ["b", "c"], "seconds": 0.05},
             {"hosts": ["c", "d"], "seconds": 0.05}, {"hosts": ["d", "a"], "seconds": 0.01}]
    named = judge({h: node(40) for h in "abcd"}, {"pairs": pairs}, 0, THRESHOLDS)
    assert list(named) == ["c"] and "slow link" in named["c"]


def test_the_line_says_when_the_ring_did_not_complete():
    from trainstack._slurm.nodecheck import describe

    check = {"figures": {"a": node(40), "b": node(41)}, "link": None, "named": {}, "seconds": 30.1}
    assert "the ring did not complete within the budget" in describe(check)
    check["link"] = {"ring_gbps": 1.25}
    assert "ring 1.25 GB/s; all nodes fit" in describe(check)
