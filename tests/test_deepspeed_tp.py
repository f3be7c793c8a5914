"""turbomoe's DeepSpeed drop-in under Megatron-style tensor parallelism (groups.mpu set), against stock.

Launches tests/ds_tp_script.py with the real deepspeed launcher on two CPU ranks (gloo) that form
one tensor-parallel group of size 2; the script passes a minimal Megatron mpu to
deepspeed.initialize(mpu=...). Stock's MOELayer then drops each TP rank to a 1/tp share of the
capacity dim before the all-to-all and gathers it back after, and dropless gating pads C to a
multiple of tp; turbomoe's TurboMOELayer and expert_capacity must do the same. See the script's
docstring for the cases.
"""
import json
import os

import pytest
from launching import ROOT, deepspeed_launch, launcher_env

pytest.importorskip("deepspeed")

SCRIPT = os.path.join(ROOT, "tests", "ds_tp_script.py")
TOL = 1e-5  # max|turbo - stock| / max|stock| per tensor, fp32


def launch(workdir, expert_tp, script=SCRIPT):
    """Run script (a tests/ file) on two gloo ranks; its per-rank JSON results."""
    env = launcher_env(cpu=True)
    env.pop("TURBOMOE_PATCH_DEEPSPEED", None)  # the script builds stock layers by name
    args = ["--workdir", workdir] + (["--expert-tp"] if expert_tp else [])
    deepspeed_launch(os.path.join(ROOT, "tests", script), *args, env=env, timeout=180)
    tag = "expert_tp" if expert_tp else "main"
    results = []
    for rank in range(2):
        with open(os.path.join(workdir, f"result_{tag}_rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def check_case(case, per_rank, ep_size):
    for rank, rec in enumerate(per_rank):
        where = (case, rank)
        assert rec["counts_equal"], where
        # output, l_aux, input gradient and every parameter gradient (gate and each local expert)
        assert set(rec["err"]) == {"out", "l_aux", "dx"} | {f"grad:{n}" for n in rec["grad_names"]}, where
        assert "deepspeed_moe.gate.wg.weight" in rec["grad_names"], where
        local_experts = {n.split(".")[3] for n in rec["grad_names"] if n.startswith("deepspeed_moe.experts.")}
        assert len(local_experts) == 4 // ep_size, where  # E = 4 experts over ep_size ranks
        bad = {n: e for n, e in rec["err"].items() if not e < TOL}
        assert not bad, (where, bad)
        # Tensor parallelism really ran and reproduces tp = 1: same output, l_aux, input gradient.
        assert all(e < TOL for e in rec["vs_tp1"].values()), (where, rec["vs_tp1"])
        if ep_size == 1:
            assert rec["vs_tp1_expert_grads"] < TOL, where
            assert rec["gate_grad_vs_tp1"] < TOL, where
    return per_rank


def test_tensor_parallel_matches_stock(tmp_path):
    results = launch(tmp_path, expert_tp=False)
    for rec in results:
        assert rec["mpu_registered"] and rec["tp"] == 2 and rec["expert_tp"] == 1
    cases = results[0]["cases"]
    assert set(cases) == set(results[1]["cases"])
    for case in cases:
        ep_size = 2 if "_ep2_" in case else 1
        per_rank = [r["cases"][case] for r in results]
        check_case(case, per_rank, ep_size)
        if ep_size == 1:
            # Each TP rank ran its experts on its share of the rows only (stock's drop_tokens): its
            # expert gradients are partial, and (checked above) sum over the TP group to tp = 1's.
            assert any(rec["expert_grads_are_partial"] for rec in per_rank), case
    # (a) capacity, nothing dropped; one top-2 case with drops.
    for case in ("a_ep1_top1_capacity", "a_ep1_top2_capacity", "b_ep2_top1_capacity", "b_ep2_top2_capacity"):
        assert not cases[case]["tokens_dropped"], case
    assert cases["a_ep1_top2_drops"]["tokens_dropped"]
    # (c) dropless: the largest count is odd, so both layers pad C to max + 1 (a multiple of tp);
    # an unpadded C would fail drop_tokens' divisibility assert.
    for case in ("c_ep1_top1_dropless", "c_ep1_top2_dropless", "c_ep2_top2_dropless"):
        for r in results:
            cap = r["cases"][case]["capacity"]
            assert cap["max_count"] % 2 == 1 and cap["stock"] == cap["turbo"] == cap["max_count"] + 1, (case, cap)


def test_expert_tensor_parallel_matches_stock(tmp_path):
    """enable_expert_tensor_parallelism=True: the TP ranks all-gather the rows after the all-to-all,
    run the (replicated) experts on all of them and drop back to their share."""
    results = launch(tmp_path, expert_tp=True)
    for rec in results:
        assert rec["mpu_registered"] and rec["tp"] == 2 and rec["expert_tp"] == 2
    for case in results[0]["cases"]:
        per_rank = check_case(case, [r["cases"][case] for r in results], ep_size=1)
        # Every TP rank runs its experts on every row: full expert gradients on each.
        assert not any(rec["expert_grads_are_partial"] for rec in per_rank), case
    for r in results:
        rec = r["cases"]["d_etp_top2_dropless"]
        cap = rec["capacity"]  # compared with stock on an even largest count: nothing to pad
        assert cap["max_count"] % 2 == 0 and cap["stock"] == cap["turbo"] == cap["max_count"], cap
        # An odd largest count: stock leaves C odd and fails drop_tokens' assert (rec["odd_max_count"]
        # ["stock_runs"], not asserted); turbomoe pads C and matches tp = 1.
        odd = rec["odd_max_count"]
        assert odd["capacity"]["max_count"] % 2 == 1 and odd["capacity"]["turbo"] == odd["capacity"]["max_count"] + 1
        assert all(e < TOL for e in odd["vs_tp1"].values()), odd["vs_tp1"]
        assert odd["vs_tp1_expert_grads"] < TOL and odd["gate_grad_vs_tp1"] < TOL, odd
