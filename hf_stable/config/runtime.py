"""Config section `runtime`: resuming and preemption — how a run survives being stopped.

Example (YAML):
    runtime:
      resume: auto                 # newest *complete* checkpoint in output_dir, else start fresh
      preemption:
        signals: [SIGTERM, SIGINT, SIGUSR1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_stable.config.fields import help_ as _h

SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass
class PreemptionConfig:
    """On a signal: finish the current optimizer step, save a checkpoint, stop, exit with `exit_code`."""

    enabled: bool = field(default=True, metadata=_h("Handle the signals below instead of dying mid-step."))
    signals: list[str] = field(
        default_factory=lambda: ["SIGTERM", "SIGINT"],
        metadata=_h(
            "Signals that request a checkpoint-and-stop (SLURM `--signal=USR1@120` sends SIGUSR1; Kubernetes and "
            "torchrun send SIGTERM; Ctrl-C sends SIGINT: the run is marked interrupted and exits 130). The launcher "
            "(`accelerate launch`, `torchrun`) forwards them to the workers. Outside a training step (loading, "
            "evaluating, writing outputs) there is nothing to save: the run stops at once, marked preempted. A second "
            "identical signal more than 5 s after the first (Ctrl-C: 1 s) stops it at once too."
        ),
    )
    exit_code: int = field(
        default=143,
        metadata=_h(
            "Exit status after a preemption save (143 = 128 + SIGTERM; after Ctrl-C always 130). Non-zero so "
            "schedulers and torchrun restart the job; with `resume: auto` the restart continues from the saved "
            "checkpoint."
        ),
    )

    grace_seconds: int = field(
        default=120,
        metadata=_h(
            "How long torch elastic (`torchrun`, `accelerate launch` with several processes) waits for the workers "
            "to finish their step and save after forwarding a signal, before it kills them (sets "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT unless already set). Make it cover one step plus one save; it is also "
            "how long a crashed rank can keep the others waiting before the job ends."
        ),
    )

    def validate(self) -> list[str]:
        out = []
        if self.grace_seconds <= 0:
            out.append(f"grace_seconds: got {self.grace_seconds}, must be > 0")
        bad = [s for s in self.signals if s not in SIGNAL_NAMES]
        if bad:
            out.append(f"signals: got {bad}, allowed: {', '.join(SIGNAL_NAMES)}")
        if not 0 <= self.exit_code <= 255:
            out.append(f"exit_code: got {self.exit_code}, must be in [0, 255]")
        return out


@dataclass
class RuntimeConfig:
    """Resume and preemption settings (the checkpoints themselves follow `training.save_strategy`)."""

    resume: str = field(
        default="auto",
        metadata=_h(
            "'auto': continue from the newest complete checkpoint in training.output_dir (start fresh if none); "
            "'never': start fresh (checkpoints already in the dir are marked superseded); or a checkpoint path "
            "(absolute, relative to the working dir, or a name like 'checkpoint-200' inside output_dir)."
        ),
    )
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    overwrite: bool = field(
        default=False,
        metadata=_h(
            "A new run into an output_dir that holds a finished run (run_summary.json): false stops with a message "
            "and changes nothing; true moves the finished run's files to <output_dir>/replaced-<time>/ (nothing is "
            "deleted) and starts fresh."
        ),
    )

    def validate(self) -> list[str]:
        if not self.resume.strip():
            return ["resume: got '', must be 'auto', 'never' or a checkpoint path"]
        return []
