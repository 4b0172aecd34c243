"""The chunked training loss under the sharded engines: DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 on 2 gloo ranks.

One `torchrun` per engine (tests/dist_scripts/chunked_loss_run.py): one step of `StableTrainer` with the model's
full-logits forward and one with the chunked loss, from the same weights (LoRA on the projections, and on lm_head
under ZeRO-2) and the same padded batches, a different batch on each rank. Each rank's step loss and full gradients must match between
the two paths (fp32: rtol 1e-5, an atol of 1e-6 x the largest gradient for elements near zero), and the ranks must
hold the same gradients. Under ZeRO-3 every weight is partitioned, the LM head's included: the chunked path calls the
head module inside the engine's forward, where the engine gathers it for each call (forward, and again in the
backward's recomputation); the ranks supervise different token counts, so without agreeing on the number of chunks
one rank would call (and gather) the head more often than the other (a collective mismatch). The LoRA on lm_head
trains under every engine: under ZeRO-3 and FSDP2 its parameters outside the module's forward are ZeRO-3's empty
partitions or FSDP2's sharded DTensors (`StepEngine.params_outside_forward`), so there each chunk runs by plain
autograd under torch.utils.checkpoint, the head module called again in the backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import session_dir, torchrun_two_ranks

SCRIPT = Path(__file__).parent / "dist_scripts" / "chunked_loss_run.py"
ENGINE_NAMES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "fsdp2": "fsdp2"}

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(600)]


def _param(engine: str):
    return pytest.param(engine, marks=[pytest.mark.deepspeed] if engine.startswith("zero") else [], id=engine)


@pytest.mark.parametrize("engine", [_param(e) for e in ENGINE_NAMES])
def test_chunked_loss_and_gradients_equal_the_full_logits_path_under_the_engine(engine):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    out = session_dir() / f"chunked_loss_{engine}"
    torchrun_two_ranks(SCRIPT, engine, str(out), timeout=540, env={"ENGINES_TIMEOUT": "480"})
    ranks = [torch.load(out / f"rank{i}.pt") for i in (0, 1)]
    for r in ranks:
        full, chunked = r[False], r[True]
        assert r["world_size"] == 2 and full["engine"] == chunked["engine"] == ENGINE_NAMES[engine]
        assert {d for d, _ in full["head_calls"]} == {3}  # the model's forward: [B, T, H] into the head
        assert chunked["head_calls"] and {d for d, _ in chunked["head_calls"]} == {2}  # chunk rows only
        torch.testing.assert_close(chunked["loss"], full["loss"], rtol=1e-5, atol=0)
        assert chunked["names"] == full["names"]
        assert any("lm_head.lora_B" in n for n in full["names"])
        assert full["checkpointed"] is None and chunked["checkpointed"] == (engine != "zero2")
        scale = max(g.abs().max().item() for g in full["grads"])
        for name, a, b in zip(full["names"], full["grads"], chunked["grads"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale, msg=lambda m, n=name: f"{n}: {m}")
        head_grads = [g for n, g in zip(full["names"], chunked["grads"], strict=True) if "lm_head.lora" in n]
        assert len(head_grads) == 2 and all(g.abs().sum() > 0 for g in head_grads)  # trained through the chunks
        if engine == "zero3":  # partitioned outside its calls, whole (gathered) inside each one
            vocab_x_hidden = 128 * 32
            assert chunked["head_weight_numel_outside"] == 0
            assert {n for _, n in chunked["head_calls"]} == {vocab_x_hidden}
    # the ranks supervise different token counts (chunks of 5 rows: different counts of their own) ...
    local_chunks = [-(-r[True]["supervised"] // 5) for r in ranks]
    assert local_chunks[0] != local_chunks[1], local_chunks
    # ... and call the head equally often under the engines that gather it per call; as often as they need elsewhere
    calls = [len(r[True]["head_calls"]) for r in ranks]
    if engine == "zero2":
        assert calls == [2 * n for n in local_chunks]  # forward + the backward's recomputation, per chunk
    else:
        assert calls == [2 * max(local_chunks)] * 2
    for path in (False, True):  # the ranks agree on the full gradients
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][path]["grads"], ranks[1][path]["grads"], strict=True))
