"""The rollback guard's disk snapshot (`storage: disk`) holds tensors only and is read with weights_only=True: a
pickle planted in its place is refused with an error naming the file, and none of its code runs."""

from __future__ import annotations

import pickle

import pytest
import torch

from hf_stable.core.snapshot import SnapshotError, SnapshotStore
from hf_stable.outputs import error_boundary


class Payload:
    """Unpickled with weights_only=False, this creates `marker` (what a planted file could do instead: anything)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _optimizer():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        sum((p**2).sum() for p in params).backward()
        opt.step()
    opt.state[params[1]]["note"] = {"python": 3, "values": [1.5, "x"]}  # a Python value in the state: kept too
    return params, opt


def test_disk_snapshot_round_trips_with_only_tensors_in_the_file(tmp_path):
    params, opt = _optimizer()
    store = SnapshotStore("disk", tmp_path / "hf_stable_rollback" / "rank0.pt")
    store.save(2, opt, guard_states={"SkipGuard": {"ema": 1.25}})
    saved = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    opt.state[params[1]]["note"] = "changed"

    step, same_optimizer, guards = store.restore(opt)
    assert (step, same_optimizer, guards) == (2, True, {"SkipGuard": {"ema": 1.25}})
    assert all(torch.equal(p, s) for p, s in zip(params, saved, strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, moments, strict=True))
    assert opt.state[params[1]]["note"] == {"python": 3, "values": [1.5, "x"]}
    raw = torch.load(store.path, weights_only=True)  # what the file holds loads without pickle's globals
    assert set(raw) == {"params", "state", "extra"}
    assert all(isinstance(v[0], torch.Tensor) for s in raw["state"].values() for v in s.values())


@pytest.mark.parametrize("planted_as", ["torch.save", "pickle"])
def test_a_planted_pickle_is_refused_naming_the_file_and_never_runs(tmp_path, capsys, planted_as):
    params, opt = _optimizer()
    path = tmp_path / "hf_stable_rollback" / "rank0.pt"
    store = SnapshotStore("disk", path)
    store.save(2, opt, guard_states={})
    marker = tmp_path / "payload_ran"
    planted = {"params": [Payload(marker)], "state": {}}
    if planted_as == "torch.save":
        torch.save(planted, path)
    else:
        path.write_bytes(pickle.dumps(planted))
    before = [p.detach().clone() for p in params]

    with pytest.raises(SnapshotError) as refused:
        store.restore(opt)
    assert not marker.exists(), "the planted payload ran"
    assert str(refused.value).startswith(f"rollback snapshot {path}")
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # nothing restored from it

    with pytest.raises(SystemExit) as stop, error_boundary():  # what the recipe shows: one line, exit 2
        store.load()
    (line,) = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and line.startswith(f"error: rollback snapshot {path}") and not marker.exists()


def _train_step(params, opt):
    opt.zero_grad()
    sum((p**2).sum() for p in params).backward()
    opt.step()


def test_memory_snapshot_refills_its_buffers_and_restores_the_latest_snapshot_only():
    params, opt = _optimizer()
    store = SnapshotStore("memory")
    store.save(2, opt, guard_states={})
    first = [id(t) for t in store._buffers]
    _train_step(params, opt)
    store.save(3, opt, guard_states={"SkipGuard": {"ema": 2.0}})
    assert [id(t) for t in store._buffers] == first  # refilled, not reallocated
    at_3 = [p.detach().clone() for p in params]
    state_3 = {i: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for i, p in enumerate(params)}
    for _ in range(2):  # the live tensors move on; the snapshot does not move with them
        _train_step(params, opt)
    assert not torch.equal(params[0], at_3[0])
    step, same_opt, guards = store.restore(opt)
    assert (step, same_opt, guards) == (3, True, {"SkipGuard": {"ema": 2.0}})
    assert all(torch.equal(p, w) for p, w in zip(params, at_3, strict=True))
    for i, p in enumerate(params):
        for key, value in state_3[i].items():
            assert torch.equal(opt.state[p][key], value), (i, key)
    assert opt.state[params[1]]["note"] == {"python": 3, "values": [1.5, "x"]}
    _train_step(params, opt)  # restoring copied out of the buffers: training on does not write into them
    store.restore(opt)
    assert all(torch.equal(p, w) for p, w in zip(params, at_3, strict=True))
