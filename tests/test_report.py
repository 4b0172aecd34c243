"""`hf-stable report OUTPUT_DIR`: events table and plots from a real run with an injected fault."""

from __future__ import annotations

import json

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_stable.callbacks.monitors import build_monitors
from hf_stable.cli import main as cli_main
from hf_stable.config import MonitorsConfig
from hf_stable.reporting.report import REPORT_DIR, REPORT_FILE, render_report
from tests.helpers import make_tiny_model


class _SpikeLoss(TrainerCallback):
    """Scales one parameter's gradient by 1e6 at one step: a gradient explosion the monitors must report."""

    def __init__(self, param, at_step):
        self.param, self.at_step, self.handle = param, at_step, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.at_step:
            self.handle = self.param.register_hook(lambda g: g * 1e6)

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_report_from_a_run_with_an_injected_fault(tokenizer, tmp_path, capsys):
    model = make_tiny_model("llama", tokenizer)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (x := torch.randint(3, 512, (24,), generator=g)), "labels": x.clone()} for _ in range(40)]
    target = model.model.embed_tokens.weight
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=8,
        logging_steps=3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_grad_norm=0.0,
        learning_rate=1e-4,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[*build_monitors(MonitorsConfig()), _SpikeLoss(target, at_step=4)],
    )
    trainer.train()
    trainer.save_state()

    assert cli_main(["report", str(tmp_path)]) == 0
    report_path = tmp_path / REPORT_DIR / REPORT_FILE
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(report_path)
    text = report_path.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 4 |")]
    assert any("grad_explosion" in r and "error" in r for r in rows), text
    assert any("grad_max_abs" in r and "embeddings" in r and "model.embed_tokens.weight" in r for r in rows), text
    for name in ("loss.png", "learning_rate.png", "grad_norms.png", "memory.png"):
        assert (tmp_path / REPORT_DIR / name).stat().st_size > 1000, name
        assert f"]({name})" in text  # links relative to report/
    assert "### At a glance" in text and "grad norm (median / max finite)" in text

    card_section = render_report(tmp_path, trainer.state.log_history)
    assert "](report/grad_norms.png)" in card_section and "| kind | count | first step | last step |" in card_section


def test_report_heatmap_for_many_groups_and_errors(tmp_path, capsys):
    history = []
    for step in range(1, 21):
        row = {
            "step": step,
            "loss": 3.0 - 0.05 * step,
            "learning_rate": 1e-4,
            "grad/norm_global": 1.0 + step,
            "mem/rss_gib": 1.0,
        }
        row.update({f"grad/norm/layer_{i}.lora_{s}": 0.1 * (i + 1) for i in range(12) for s in "AB"})
        row["grad/norm/layer_3.lora_B"] = float("nan") if step == 7 else 0.4
        history.append(row)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert cli_main(["report", str(tmp_path)]) == 0
    text = (tmp_path / REPORT_DIR / REPORT_FILE).read_text()
    assert "No stability events were recorded" in text
    assert (tmp_path / REPORT_DIR / "grad_norms.png").stat().st_size > 1000

    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["report", str(empty)]) == 2
    assert "neither trainer_state.json" in capsys.readouterr().err


def test_card_plot_draws_the_loss_the_report_draws(tmp_path):
    """One loss drawing for the model card's loss/LR plot and the report's loss plot: a history with only the
    per-step loss (`loss/train`) and a NaN step gives both a plot with the same loss line and the NaN marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_stable.reporting.plots import plot_loss_lr
    from hf_stable.reporting.stability_plots import draw_loss, plot_loss

    history = [{"step": s, "loss/train": 3.0 / s} for s in range(1, 7)] + [{"step": 7, "loss/train": float("nan")}]
    assert plot_loss_lr(history, tmp_path / "card.png") is not None  # before: None (it read only "loss")
    assert plot_loss(history, [], tmp_path / "report.png") is not None
    assert plot_loss_lr([{"step": 1, "grad/norm_global": 1.0}], tmp_path / "none.png") is None
    fig, ax = plt.subplots()
    assert draw_loss(ax, history, [])
    labels = [line.get_label() for line in ax.get_lines()]
    plt.close(fig)
    assert labels == ["train loss (each step)", "non-finite loss"]


def test_log_history_reads_the_newest_checkpoint_when_the_run_left_no_state(tmp_path):
    from hf_stable.reporting.report import load_log_history

    for step in (2, 10, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": step}]}))
    (tmp_path / "checkpoint-12.tmp").mkdir()  # not a checkpoint name: ignored
    assert load_log_history(tmp_path) == [{"step": 10}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 11}]}))
    assert load_log_history(tmp_path) == [{"step": 11}]
