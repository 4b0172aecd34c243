"""The hf_stable error family.

Every error a user can cause (bad config, bad data, a missing path) is an `HfStableError`, so the
recipe can print one clear message and exit non-zero instead of a traceback wall. Messages say what
happened, where (file:line, field, parameter, step) and how to fix it.
"""

from __future__ import annotations

MAX_PROBLEM_CHARS = 1000


class HfStableError(Exception):
    """Base class of every error hf_stable raises on purpose.

    `rank_local` says whether the failure is this rank's own (a file of its own, a disk of its node): with several
    ranks the recipe prints such a message on the rank that has it, naming the rank. Every other error comes from
    what all ranks read alike (the config, the data, the model, decisions rank 0 shares), so every rank stops with
    the same message and rank 0 alone prints it.

    `exit_code` is what the recipe exits with (2: the input was wrong; 1: the run itself failed, e.g. replicas that
    disagree) and `reason`, when set, is the short cause recorded in RUN_INCOMPLETE.json next to the message.
    """

    rank_local: bool = False
    exit_code: int = 2
    reason: str | None = None


class ConfigError(HfStableError):
    """A configuration problem. Carries every problem found, not just the first.

    Args:
        problems: one human-readable line per problem, each naming the key, the value and what is allowed.
        source: the config file the problems come from, when there is one.
    """

    def __init__(self, problems: list[str] | str, source: str | None = None):
        problems = [problems] if isinstance(problems, str) else list(problems)
        # a value shown in full could be megabytes (a pasted data file, an expanded alias): keep lines readable
        self.problems = [p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS] + " ... (cut)" for p in problems]
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s){where}:\n{lines}")


class DataError(HfStableError):
    """A problem with training data: malformed record, missing field, bad token ids."""


class ModelError(HfStableError):
    """A problem loading or building a model or tokenizer (missing path, unknown architecture)."""


class Preempted(BaseException):
    """A termination signal arrived outside a training step, where there is nothing to save (see
    `hf_stable.callbacks.preemption_callback.stop_on_signals`). A `BaseException`, like `KeyboardInterrupt`, so
    that no `except Exception` on the way turns it into another error.

    Args:
        signal_name: e.g. "SIGTERM".
        exit_code: the exit status the run ends with (`runtime.preemption.exit_code`; 130 for SIGINT).
        note: what happened, for RUN_INCOMPLETE.json (default: stopped outside a training step, nothing saved).
    """

    def __init__(self, signal_name: str, exit_code: int = 143, note: str | None = None):
        super().__init__(f"{signal_name} received")
        self.signal_name, self.exit_code = signal_name, int(exit_code)
        self.note = note  # what was saved, when it is not "stopped outside a training step: nothing was saved"


class MissingDependencyError(HfStableError, ImportError):
    """An optional extra is needed for what was asked."""


class ExportError(HfStableError):
    """A merged export cannot be written or does not reproduce the trained model (`hf-stable export`)."""
