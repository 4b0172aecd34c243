"""`ForensicsConfig`: the settings of `hf_stable.callbacks.spike_forensics.SpikeForensics`. The user-facing keys are
``data.quarantine`` and ``data.screen`` (`DataConfig`); the thresholds below are calibrated defaults (see
benchmarks/README.md, "forensics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ForensicsConfig:
    """Settings of `SpikeForensics` (the user-facing keys are ``data.quarantine`` and ``data.screen``)."""

    quarantine: Literal["auto", "report", "off"] = field(
        default="auto", metadata={"help": "auto: never sample culprits again; report: file only; off: nothing."}
    )
    screen: bool = field(default=False, metadata={"help": "Screen every step's per-sample losses for outliers."})
    zscore: float = field(default=5.0, metadata={"help": "A culprit's robust z over the reference is above this..."})
    min_rel: float = field(default=1.0, metadata={"help": "... and its loss this fraction above the median."})
    min_excess_nats: float = field(
        default=40.0,
        metadata={"help": "... and its loss above the step's median, summed over its tokens, at least this (nats)."},
    )
    max_culprits: int = field(default=4, metadata={"help": "At most this many culprits per bad step (highest z)."})
    grad_norms: bool = field(default=True, metadata={"help": "Per-sample gradient norm of each culprit (re-run)."})
    max_grad_samples: int = field(
        default=64, metadata={"help": "A gradient spike with no loss outlier: re-run up to this many samples alone."}
    )
    window: int = field(
        default=1024, metadata={"help": "Healthy samples' loss / step-median ratios kept as the reference."}
    )
    min_reference: int = field(
        default=64, metadata={"help": "Healthy per-sample losses needed before they are the reference."}
    )
    screen_every: int = field(default=8, metadata={"help": "Screening decisions every N steps (one gather)."})
    suspect_zscore: float = field(
        default=3.0,
        metadata={"help": "Screening: a sample this far out (robust z) but short of a culprit is a suspect..."},
    )
    suspect_excess_nats: float = field(
        default=10.0,
        metadata={
            "help": "... with its loss above the step's median, summed over its tokens, at least this (nats)..."
        },
    )
    prompt_gain_min: float = field(
        default=1.3,
        metadata={
            "help": "... and a culprit when its answer's loss with its prompt is at least this multiple of its "
            "loss after an empty prompt (above 1: the prompt makes the answer less likely)."
        },
    )
    max_suspects: int = field(default=8, metadata={"help": "Suspects re-run per screening decision (highest z)."})
    trajectory: bool = field(
        default=True,
        metadata={
            "help": "With screening: keep every record's loss and margin by sighting and, at the end of each "
            "epoch, name the records whose trajectory stands out (hf_stable.forensics.trajectory)."
        },
    )
    trajectory_min_sightings: int = field(
        default=2, metadata={"help": "Trajectory rule: only records seen at least this many times (epochs)..."}
    )
    trajectory_zscore: float = field(
        default=3.25,
        metadata={"help": "... named when their score (mean robust z of the trajectory features) is above this."},
    )
    trajectory_early_zscore: float = field(
        default=5.0,
        metadata={
            "help": "... and a record seen fewer times (one epoch) when its score is above this higher bar: the "
            "plainest cases leave the run an epoch sooner (1e9: only records seen trajectory_min_sightings times)."
        },
    )
    trajectory_gain_weight: float = field(
        default=8.0,
        metadata={"help": "... plus this x ln(the prompt gain screening measured, when above 1) in the score."},
    )
    trajectory_min_population: int = field(
        default=64, metadata={"help": "Trajectory rule: no verdict with fewer records to compare against."}
    )
    trajectory_sightings: int = field(default=4, metadata={"help": "Sightings kept per record (the latest)."})
    trajectory_max_records: int = field(
        default=1_000_000, metadata={"help": "Record ids tracked by the trajectory table (its memory bound)."}
    )

    @classmethod
    def from_data(cls, data) -> ForensicsConfig:
        return cls(quarantine=data.quarantine, screen=bool(data.screen))
