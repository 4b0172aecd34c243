"""Timing pieces of `step_overhead.py`: per-step exclusive region times, the instrumented per-callback timers, and
the baton that interleaves several arms' training steps one by one in one process."""

from __future__ import annotations

import functools
import statistics
import threading
import time

WARMUP = 2  # steps 1-2 of each run are left out (and the last), here and in step_overhead.py


class Profile:
    """Exclusive time per named region, per training step (regions nest: a parent's time excludes its children)."""

    def __init__(self, clock):
        self.now = clock
        self.stack: list[list] = []
        self.steps: list[dict[str, float]] = []
        self.marks: list[float] = []

    def mark_step(self) -> None:
        self.marks.append(self.now())
        self.steps.append({})

    def push(self, name: str) -> None:
        self.stack.append([name, self.now(), 0.0])

    def pop(self) -> None:
        name, start, child = self.stack.pop()
        elapsed = self.now() - start
        if self.stack:
            self.stack[-1][2] += elapsed
        if self.steps:
            self.steps[-1][name] = self.steps[-1].get(name, 0.0) + elapsed - child

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop()

        return timed

    def summary(self) -> dict[str, float]:
        """Mean ms per timed step: each region, `callbacks` (their sum), `other` and `total`."""
        rows = []
        for k in range(WARMUP, len(self.marks) - 1):
            row = {name: 1e3 * s for name, s in self.steps[k].items()}
            row["total"] = 1e3 * (self.marks[k + 1] - self.marks[k])
            row["callbacks"] = sum(v for n, v in row.items() if n.startswith("cb:"))
            row["other"] = row["total"] - sum(v for n, v in row.items() if n not in ("total", "callbacks", "other"))
            rows.append(row)
        names = {n for row in rows for n in row}
        return {n: statistics.fmean(row.get(n, 0.0) for row in rows) for n in names}


def time_parts(trainer, profile: Profile) -> None:
    """Time the parts every arm has: forward (`compute_loss`), backward, grad norm (the clip or the norm alone)."""
    trainer.compute_loss = profile.wrap(trainer.compute_loss, "forward")
    trainer.accelerator.backward = profile.wrap(trainer.accelerator.backward, "backward")
    trainer._clip_grad_norm = profile.wrap(trainer._clip_grad_norm, "grad norm")
    trainer._get_grad_norm = profile.wrap(trainer._get_grad_norm, "grad norm")


def instrument(trainer, profile: Profile, skip) -> None:
    """Time the trainer's parts and every callback hook that is not TrainerCallback's no-op."""
    from transformers import TrainerCallback

    time_parts(trainer, profile)
    hooks = [n for n in vars(TrainerCallback) if n.startswith("on_")]
    for cb in trainer.callback_handler.callbacks:
        if cb is skip:
            continue
        for hook in hooks:
            if getattr(type(cb), hook, None) is not getattr(TrainerCallback, hook):
                setattr(cb, hook, profile.wrap(getattr(cb, hook), f"cb:{type(cb).__name__}"))


def make_clock_callback(profile: Profile, sync):
    from transformers import TrainerCallback

    class StepMarks(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
            self.handles = [
                inner.register_step_pre_hook(lambda *a: profile.push("optimizer")),
                inner.register_step_post_hook(lambda *a: profile.pop()),
            ]

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            profile.mark_step()

        def on_train_end(self, args, state, control, **kwargs):
            sync()
            profile.mark_step()
            for h in self.handles:
                h.remove()

    return StepMarks()


class Baton:
    """Lets one arm's training thread run at a time, handed on at every step, so the arms' steps alternate one by one
    and a machine whose speed drifts (a shared host) slows both alike."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.n, self.arrived, self.turn, self.done = n, 0, None, set()

    def arrive(self, i: int) -> None:
        with self.cond:
            self.arrived += 1
            if self.arrived == self.n:
                self.turn = 0
                self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == i)

    def pass_on(self, i: int) -> None:
        with self.cond:
            live = [j for j in range(self.n) if j not in self.done]
            if live:
                self.turn = live[(live.index(i) + 1) % len(live)] if i in live else live[0]
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == i or i in self.done)

    def finish(self, i: int) -> None:
        with self.cond:
            self.done.add(i)
            live = [j for j in range(self.n) if j not in self.done]
            self.turn = live[0] if live else None
            self.cond.notify_all()
            self.cond.wait_for(lambda: len(self.done) == self.n)  # no post-training work beside another's steps


def interleave(trainer, baton: Baton, i: int, profile: Profile, steps: list, sync) -> None:
    """Time `trainer`'s steps in an interleaved run: each step from taking the baton to handing it on (the handing on
    happens in the handler's `on_step_begin`, outside the timed callbacks), with the few parts every arm has timed
    alike: forward, backward, grad norm, optimizer, and the callbacks as a whole (the handler's `call_event`)."""
    handler, clock = trainer.callback_handler, profile.now
    time_parts(trainer, profile)
    handler.call_event = profile.wrap(handler.call_event, "cb:all")
    begin, step_begin, end = handler.on_train_begin, handler.on_step_begin, handler.on_train_end
    start: list = []

    def on_train_begin(args, state, control):
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        inner.register_step_pre_hook(lambda *a: profile.push("optimizer"))
        inner.register_step_post_hook(lambda *a: profile.pop())
        control = begin(args, state, control)
        baton.arrive(i)
        return control

    def on_step_begin(args, state, control):
        sync()
        if start:
            steps.append(clock() - start[-1])
        baton.pass_on(i)
        start.append(clock())
        profile.mark_step()
        return step_begin(args, state, control)

    def on_train_end(args, state, control):
        sync()
        steps.append(clock() - start[-1])
        baton.finish(i)
        return end(args, state, control)

    handler.on_train_begin, handler.on_step_begin, handler.on_train_end = on_train_begin, on_step_begin, on_train_end


def step_clock(clock: str):
    return time.thread_time if clock == "thread" else time.perf_counter


def step_sync(clock: str, args=None):
    import torch

    cuda = torch.cuda.is_available() and not (args is not None and args.use_cpu)
    return torch.cuda.synchronize if cuda and clock == "wall" else (lambda: None)
