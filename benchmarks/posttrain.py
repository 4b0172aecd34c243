"""Post-training benchmark: real TRL trainers (DPO, KTO, GRPO; tiny LoRA Llama, CPU, TRL's defaults) under
`hf_stable.stabilize` against stock TRL.

    OMP_NUM_THREADS=1 python benchmarks/posttrain.py [--seeds 0,1,2] [--steps 20] [--part clean,faults,rewards,rl,clip]

* ``clean``: DPO and GRPO, no fault, per seed: guards on (`stabilize`), guards off (`stabilize` with
  ``guards.enabled: false``: monitors only) and stock TRL. Columns: skipped steps, rollbacks, the final objective (DPO:
  mean loss of the last 5 steps; GRPO: mean reward of the last 5 steps). A false alarm is a skip or a rollback here.
* ``faults``: DPO, KTO and GRPO with one fault at step 9 (a NaN forward, a NaN LoRA gradient, every gradient x1e3),
  stock TRL vs `stabilize`: did the run complete, are the weights finite, was the step skipped.
* ``rewards``: GRPO (batch 8, 4 generations, the dense digit reward) per seed: a clean run under `stabilize`, and
  one completion's reward replaced by ``inf`` or NaN on the reward function's 9th call (step 9), stock TRL vs
  `stabilize`: completes, weights finite, the `reward_nonfinite` event (its step and count), skipped, and the final
  reward (mean of the last 5 steps) against the clean run's. The clean column counts `PostTrainMonitor` warnings.
* ``rl``: GRPO (batch 8, 4 generations, the dense digit reward) per seed, stock TRL vs `stabilize`, against a clean
  run: NaN old log-probs at steps 9-10, every importance ratio x22026 (old log-probs - 10) at steps 9-10
  (`RolloutFaults`), and a KL push (beta 0.04, the policy's head x30 so the tiny policy can move away from its
  reference; every LoRA B + N(0, 1) before step 9, against a clean run with the same head): completes, weights
  finite, the warning-level events raised (kind@step), skipped steps, and the final reward (mean of the last 5
  steps) against the clean run's (%). The seed draws the prompts and the sampling RNG.
* ``clip``: healthy DPO at LR 2e-3 with the adaptive ClipGuard forced on (the objective's default is off): the steps
  it scaled, and the smallest coefficient.

The tiny policy and the data come from `tests/dist_scripts/posttrain_common.py` (the tests' own).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist_scripts"))

from posttrain_common import RolloutFaults, StepFaults, all_finite, build_trainer, prompt_rows, quiet, trainable

import hf_stable
from hf_stable.config import RunConfig
from hf_stable.core.events import read_events

FAULT_STEP = 9  # after 3 accepted steps with a learning signal (the references are warm); GRPO step 9 has a signal
FAULTS = {
    "nan_forward": {"nan_forward": [FAULT_STEP]},
    "nan_grad": {"nan_grad": [FAULT_STEP]},
    "x1e3": {"scale_grad": {FAULT_STEP: 1e3}},
}


def _objective(trainer, kind: str) -> float:
    rows = [h for h in trainer.state.log_history if "loss" in h and "step" in h and "train_runtime" not in h]
    key = "reward" if kind == "grpo" else "loss"
    last = [h[key] for h in rows[-5:] if key in h]
    return sum(last) / max(1, len(last))


def _events(out: Path) -> list[dict]:
    return read_events(out) if (out / "stability_events.jsonl").exists() else []


def clean_run(kind: str, mode: str, seed: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"clean-{kind}-{mode}-{seed}"
    trainer = build_trainer(
        kind, out, seed=seed, max_steps=steps, **({"beta": 1.0, "learning_rate": 5e-3} if kind == "dpo" else {})
    )
    if mode != "stock":
        cfg = RunConfig()
        cfg.stability.guards.enabled = mode == "guards_on"
        hf_stable.stabilize(trainer, cfg)
    quiet(trainer.train)
    events = _events(out)
    return {
        "skips": sum(e["kind"] == "step_skipped" for e in events),
        "rollbacks": sum(e["kind"] == "rollback" for e in events),
        "objective": _objective(trainer, kind),
    }


def fault_run(kind: str, fault: str, stabilized: bool, tmp: Path) -> dict:
    out = tmp / f"fault-{kind}-{fault}-{int(stabilized)}"
    trainer = build_trainer(
        kind, out, max_steps=FAULT_STEP + 2, **({"per_device_train_batch_size": 8} if kind == "grpo" else {})
    )
    faults = StepFaults(trainer.model, **FAULTS[fault])
    trainer.add_callback(faults)
    if stabilized:
        hf_stable.stabilize(trainer)
    completed, error = True, ""
    try:
        quiet(trainer.train)
    except Exception as e:  # noqa: BLE001 - stock GRPO crashes at its next sampling after a NaN step
        completed, error = False, type(e).__name__
    skipped = FAULT_STEP in [e["step"] for e in _events(out) if e["kind"] == "step_skipped"]
    weights = trainable(trainer.model)
    return {"completed": completed, "finite": all_finite(weights), "skipped": skipped, "error": error}


def faulty_reward(value: float, at_call: int):
    """The digit reward with completion 1 scored `value` on call `at_call` (one call per generation batch)."""
    calls = [0]

    def digit_reward(completions, **kwargs):
        calls[0] += 1
        out = [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]
        if calls[0] == at_call:
            out[1] = value
        return out

    return digit_reward


def reward_run(fault: str, stabilized: bool, seed: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"reward-{fault}-{int(stabilized)}-{seed}"
    value = {"inf": math.inf, "nan": math.nan}.get(fault)
    reward = faulty_reward(value, FAULT_STEP) if value is not None else faulty_reward(0.0, -1)
    trainer = build_trainer("grpo", out, seed=seed, reward=reward, max_steps=steps, per_device_train_batch_size=8)
    if stabilized:
        hf_stable.stabilize(trainer)
    completed = True
    try:
        quiet(trainer.train)
    except Exception:  # noqa: BLE001 - a crash is a result here
        completed = False
    events = _events(out)
    named = [e for e in events if e["kind"] == "reward_nonfinite"]
    return {
        "completed": completed,
        "finite": all_finite(trainable(trainer.model)),
        "event": ", ".join(f"step {e['step']} {e['reward_function']} {e['completions']}/{e['of']}" for e in named),
        "skipped": sum(e["kind"] == "step_skipped" for e in events),
        "warnings": sum(e.get("source") == "PostTrainMonitor" and e.get("severity") == "warning" for e in events),
        "reward": _objective(trainer, "grpo"),
    }


RL_CASES = {
    "clean": {},
    "nan_old": {"nan_old": [FAULT_STEP, FAULT_STEP + 1]},
    "ratio": {"ratio": [FAULT_STEP, FAULT_STEP + 1]},
    "clean_sharp": {},
    "kl_push": {},
}


def _push(trainer, step: int, seed: int):
    """Every LoRA B + N(0, 1) at the start of optimizer step `step` (the policy pushed from its reference)."""
    import torch
    from transformers import TrainerCallback

    class Push(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == step:
                g = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    for n, p in trainer.model.named_parameters():
                        if "lora_B" in n:
                            p.add_(torch.randn(p.shape, generator=g))

    trainer.add_callback(Push())


def rl_run(case: str, stabilized: bool, seed: int, steps: int, tmp: Path) -> dict:
    import torch

    out = tmp / f"rl-{case}-{int(stabilized)}-{seed}"
    sharp = case in ("clean_sharp", "kl_push")
    trainer = build_trainer(
        "grpo",
        out,
        seed=seed,
        data=prompt_rows(seed=seed),
        max_steps=steps,
        per_device_train_batch_size=8,
        **({"beta": 0.04} if sharp else {}),
    )
    if sharp:
        with torch.no_grad():
            trainer.model.get_output_embeddings().weight.mul_(30.0)
    if case == "kl_push":
        _push(trainer, FAULT_STEP, seed)
    RolloutFaults(trainer, **RL_CASES[case])
    if stabilized:
        hf_stable.stabilize(trainer)
    torch.manual_seed(seed)  # the sampling RNG (the LoRA B starts at 0: the seed alone leaves the policy as it is)
    completed, error = True, ""
    try:
        quiet(trainer.train)
    except Exception as e:  # noqa: BLE001 - a crash is a result here
        completed, error = False, type(e).__name__
    events = _events(out)
    said = [f"{e['kind']}@{e['step']}" for e in events if e.get("severity") in ("warning", "error", "critical")]
    return {
        "completed": completed,
        "error": error,
        "finite": all_finite(trainable(trainer.model)),
        "events": ", ".join(dict.fromkeys(said)) or "none",
        "skips": sorted(e["step"] for e in events if e["kind"] == "step_skipped"),
        "reward": _objective(trainer, "grpo") if completed else math.nan,
    }


def rl_table(seeds: list[int], steps: int, tmp: Path) -> None:
    print(
        "| case | seed | stock: completes / finite / reward vs clean | stabilize: completes / finite / events "
        "(warning+) / skipped steps / reward vs clean |"
    )
    print("|---|---|---|---|---|")
    for seed in seeds:
        clean = {}
        for case in RL_CASES:
            s, h = rl_run(case, False, seed, steps, tmp), rl_run(case, True, seed, steps, tmp)
            if case.startswith("clean"):
                clean[case] = h["reward"]
            ref = clean["clean_sharp" if case in ("clean_sharp", "kl_push") else "clean"]

            def rel(r, ref=ref):
                return f"{r['reward']:.4f} ({100 * (r['reward'] / ref - 1):+.1f}%)" if ref else f"{r['reward']:.4f}"

            stock = f"{'yes' if s['completed'] else 'no (' + s['error'] + ')'} / {'yes' if s['finite'] else 'NO'}"
            ours = f"{'yes' if h['completed'] else 'no'} / {'yes' if h['finite'] else 'NO'} / {h['events']}"
            print(f"| {case} | {seed} | {stock} / {rel(s)} | {ours} / {h['skips'] or 'none'} / {rel(h)} |", flush=True)


def clip_run(steps: int, tmp: Path) -> tuple[int, float, int]:
    out = tmp / "clip"
    trainer = build_trainer("dpo", out, max_steps=steps, learning_rate=2e-3, beta=1.0)
    hf_stable.stabilize(trainer)  # the DPO family turns adaptive clipping off; add it back, after the skip guard
    from hf_stable.callbacks import order_for_reporting
    from hf_stable.callbacks.guards import ClipGuard, SkipGuard

    skip = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SkipGuard))
    trainer.add_callback(ClipGuard(skip_guard=skip))
    order_for_reporting(trainer)
    quiet(trainer.train)
    coefs = [h["clip/coef_min"] for h in trainer.state.log_history if "clip/coef_min" in h]
    return sum(c < 1.0 for c in coefs), min(coefs) if coefs else 1.0, len(coefs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--part", default="clean,faults,clip")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    parts = a.part.split(",")
    logging.getLogger("hf_stable").setLevel(logging.CRITICAL)
    tmp = Path(tempfile.mkdtemp(prefix="posttrain_bench_"))
    if "clean" in parts:
        print("| trainer | seed | arm | skipped | rollbacks | final objective |")
        print("|---|---|---|---|---|---|")
        for kind in ("dpo", "grpo"):
            for seed in seeds:
                for mode in ("guards_on", "guards_off", "stock"):
                    r = clean_run(kind, mode, seed, a.steps, tmp)
                    what = "mean reward" if kind == "grpo" else "DPO loss"
                    print(
                        f"| {kind} | {seed} | {mode} | {r['skips']} | {r['rollbacks']} | "
                        f"{what} {r['objective']:.4f} |",
                        flush=True,
                    )
    if "faults" in parts:
        print(
            f"\n| trainer | fault (step {FAULT_STEP}) | stock: completes / finite | stabilize: completes / finite / skipped |"
        )
        print("|---|---|---|---|")
        for kind in ("dpo", "kto", "grpo"):
            for fault in FAULTS:
                s = fault_run(kind, fault, False, tmp)
                h = fault_run(kind, fault, True, tmp)
                stock = f"{'yes' if s['completed'] else 'no (' + s['error'] + ')'} / {'yes' if s['finite'] else 'NO'}"
                ours = f"{'yes' if h['completed'] else 'no'} / {'yes' if h['finite'] else 'NO'} / "
                ours += "yes" if h["skipped"] else "no"
                print(f"| {kind} | {fault} | {stock} | {ours} |", flush=True)
    if "rewards" in parts:
        print(
            "\n| seed | clean (stabilize): warnings / skipped / reward | fault | stock: completes / finite / reward "
            "| stabilize: completes / finite / event / skipped / reward |"
        )
        print("|---|---|---|---|---|")
        for seed in seeds:
            c = reward_run("none", True, seed, a.steps, tmp)
            clean = f"{c['warnings']} / {c['skipped']} / {c['reward']:.4f}"
            for fault in ("inf", "nan"):
                s = reward_run(fault, False, seed, a.steps, tmp)
                h = reward_run(fault, True, seed, a.steps, tmp)

                def rel(r, c=c):
                    return f"{r['reward']:.4f} ({100 * (r['reward'] / c['reward'] - 1):+.1f}%)"

                print(
                    f"| {seed} | {clean} | {fault} | {'yes' if s['completed'] else 'no'} / "
                    f"{'yes' if s['finite'] else 'NO'} / {rel(s)} | {'yes' if h['completed'] else 'no'} / "
                    f"{'yes' if h['finite'] else 'NO'} / {h['event'] or 'none'} / {h['skipped']} / {rel(h)} |",
                    flush=True,
                )
    if "rl" in parts:
        print()
        rl_table(seeds, a.steps, tmp)
    if "clip" in parts:
        scaled, low, n = clip_run(3 * a.steps, tmp)
        print(
            f"\nadaptive ClipGuard forced on, healthy DPO LR 2e-3: scaled {scaled}/{n} steps, min coefficient {low:.3f}"
        )


if __name__ == "__main__":
    main()
