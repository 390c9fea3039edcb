"""``paratrain report``: report.png for every run, several runs compared, and figures that
agree with the console (ps's summed throughput, its memory ledger)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.parallel.ps.shared_memory import resolve_transport
from paratrain.reports.compare import compare_rows, format_compare
from paratrain.reports.metrics_file import read_metrics
from paratrain.reports.plot import PANEL_TITLES, draw_runs
from paratrain.reports.run_data import load_run
from paratrain.reports.text import memory_line, summarize_run

PNG = b"\x89PNG\r\n\x1a\n"
HIDDEN, DEPTH, INPUTS, CLASSES = 32, 1, 784, 10
# mlp(hidden=32, depth=1) on synthetic 784-feature, 10-class data: two Linear layers.
PARAMETERS = INPUTS * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
STRATEGIES = ("dp", "ps", "pipeline")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One tiny run per strategy (4 steps), with the console summary each printed."""
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for strategy in STRATEGIES:
        run_dir = root / strategy
        args = ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic"]
        args += ["--hidden", str(HIDDEN), "--depth", str(DEPTH), "--devices", "2"]
        args += ["--steps", "4", "--global-batch", "16", "--eval-every", "2"]
        args += ["--log-every", "1", "--strategy", strategy, "--run-dir", str(run_dir)]
        console = _captured(lambda args=args: main(args))
        made[strategy] = (run_dir, console)
    return made


def _captured(call) -> str:
    """stdout of ``call()``, which must return 0 (module fixtures cannot take capsys)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert call() == 0
    return buffer.getvalue()


def summary_of(run_dir: Path) -> dict:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "summary"][-1]


def console_figure(console: str, label: str) -> str:
    return re.search(rf"^  {label}\s+([\d,.]+)", console, re.MULTILINE).group(1)


# ------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_report_writes_a_png_with_the_expected_panels(runs, strategy, tmp_path):
    run_dir, _ = runs[strategy]
    out = _captured(lambda: main(["report", str(run_dir), "--out", str(tmp_path)]))
    assert f"report              {tmp_path / 'report.png'}" in out
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG
    titles = draw_runs([load_run(run_dir)], tmp_path / "again.png")
    # mlp is a classifier, so every run records accuracy and gets its panel
    panels = ("loss_step", "loss_time", "throughput", "accuracy", "memory")
    expected = [PANEL_TITLES[k] for k in panels]
    if strategy == "ps":
        expected += [PANEL_TITLES["staleness"], PANEL_TITLES["pushes"]]
    assert titles == expected


@pytest.mark.slow
def test_ps_summary_record_and_report_agree_with_the_console(runs):
    run_dir, console = runs["ps"]
    summary = summary_of(run_dir)
    # The console prints these two figures from the same floats the parent writes.
    assert f"{summary['final_train_loss']:.4f}" == console_figure(console, "final train loss")
    assert f"{summary['samples_per_s']:,.1f}" == console_figure(console, "throughput")
    # The run's throughput is its workers' sum, added in rank order as the parent does:
    # the same float additions, so equal exactly (and twice worker 0's share, roughly).
    shares = summary["worker_samples_per_s"]
    assert summary["samples_per_s"] == sum(shares[str(w)] for w in range(2))
    text = summarize_run(load_run(run_dir))
    assert f"samples/s           {summary['samples_per_s']:,.1f} (the workers' sum" in text
    assert f"-> {summary['final_train_loss']:.4f}" in text
    assert "push staleness    0: 8 (applied pushes by versions behind)" in text
    assert "pushes/s          worker 0:" in text and "worker 1:" in text


@pytest.mark.slow
def test_ps_workers_keep_a_memory_ledger(runs):
    run_dir, console = runs["ps"]
    memory = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "memory"]
    assert sorted(r["worker"] for r in memory) == [0, 1]
    # Each worker holds the whole fp32 model and its gradients; the servers hold the
    # optimizer state; activations are measured on the first step. Over shared memory the
    # parameters and gradients live in one region each, counted by storage: one flat fp32
    # tensor rounded up to the 64-byte cache line (``shared_memory.region_bytes``).
    held = 4 * PARAMETERS
    if resolve_transport("auto") == "shared_memory":
        held = -(-held // 64) * 64
    for record in memory:
        assert record["peak"]["parameters"] == held
        assert record["peak"]["gradients"] == held
        assert record["peak"]["optimizer"] == 0
        assert record["peak"]["activations"] > 0
        assert record["peak_total"] >= 2 * held
    assert not re.search(r"ledger peak\s+worker 0: 0 B", console)
    assert " 0 B (" not in summarize_run(load_run(run_dir))


@pytest.mark.slow
def test_dp_summary_record_agrees_with_the_console(runs):
    run_dir, console = runs["dp"]
    summary = summary_of(run_dir)
    assert f"{summary['samples_per_s']:,.1f}" == console_figure(console, "throughput")
    assert f"{summary['final_train_loss']:.4f}" == console_figure(console, "final train loss")


@pytest.mark.slow
def test_comparing_runs_prints_a_table_from_the_metrics_and_overlays_them(runs, tmp_path):
    dirs = [str(runs[s][0]) for s in ("dp", "ps")]
    out = _captured(lambda: main(["report", *dirs, "--out", str(tmp_path)]))
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG
    for name in ("dp", "ps"):
        records = read_metrics(runs[name][0] / "metrics.jsonl")
        summary = [r for r in records if r["kind"] == "summary"][-1]
        evals = [r for r in records if r["kind"] == "eval"]
        best = min(evals, key=lambda r: r["eval_loss"])
        row = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        cells = re.split(r"\s{2,}", row)
        assert cells == [
            name,
            name,
            "2",  # --devices 2, none lost
            f"{summary['final_train_loss']:.4f}",
            f"{summary['final_eval_loss']:.4f}",
            f"{summary['samples_per_s']:,.1f}",
            f"{best['eval_loss']:.4f} (eval)",
            str(best["step"]),
            f"{best['time_s']:.2f} s",
        ]
    titles = draw_runs([load_run(d) for d in dirs], tmp_path / "both.png")
    assert PANEL_TITLES["staleness"] in titles  # one ps run among them is enough


# ------------------------------------------------------------------- written records


def write_run(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def config(strategy: str = "dp") -> dict:
    settings = {"model": "lenet", "dataset": "synthetic_images", "strategy": strategy}
    return {"kind": "config", "time_s": 0.0, "workers": 2, "config": settings}


def train(step: int, loss: float, time_s: float, **extra) -> dict:
    return {"kind": "train", "time_s": time_s, "step": step, "loss": loss, **extra}


def test_accuracy_panel_appears_when_records_have_accuracy(tmp_path):
    pytest.importorskip("matplotlib")
    plain = write_run(tmp_path / "plain", [config(), train(1, 2.0, 0.1, samples_per_s=0.0)])
    scored = write_run(
        tmp_path / "scored",
        [
            config(),
            train(1, 2.0, 0.1, samples_per_s=0.0, accuracy=0.25),
            {"kind": "eval", "time_s": 0.2, "step": 1, "eval_loss": 1.9, "accuracy": 0.3},
        ],
    )
    assert PANEL_TITLES["accuracy"] not in draw_runs([load_run(plain)], tmp_path / "a.png")
    titles = draw_runs([load_run(scored)], tmp_path / "b.png")
    assert titles[3] == PANEL_TITLES["accuracy"]
    text = summarize_run(load_run(scored))
    assert "train accuracy      25.00% (step 1)" in text
    assert "eval accuracy       30.00% (step 1)" in text


def test_a_resumed_run_keeps_its_wall_time_running(tmp_path):
    # Each attempt's writer starts its clock at 0: the second attempt's records come after
    # the first's last one (2.0 s), so its 0.5 s reads 2.5 s.
    run_dir = write_run(
        tmp_path / "resumed",
        [config(), train(1, 2.0, 1.0), train(2, 1.5, 2.0), config(), train(3, 1.0, 0.5)],
    )
    run = load_run(run_dir)
    assert [r["time_s"] for r in run.train] == [1.0, 2.0, 2.5]
    assert run.best_loss() == ("train", 1.0, 3, 2.5)
    assert compare_rows([run])[0].time_to_best_s == 2.5


def memory(worker: int, parameters: int, gradients: int) -> dict:
    peak = {"parameters": parameters, "gradients": gradients}
    return {"kind": "memory", "worker": worker, "peak": peak, "peak_total": parameters}


def test_a_run_resumed_under_another_layout_reports_its_last_attempt(tmp_path):
    """dp on 2 workers, resumed as zero2 on 4, then as zero2 on 2: the header, the
    strategy's own figures and the memory lines are the last attempt's (the one whose
    summary the console printed last), not the first's, and no worker of an earlier
    layout is left among them."""
    first, second, third = config("dp"), {**config("zero2"), "workers": 4}, config("zero2")
    step = {"samples_per_s": 9.0}
    records = [first, train(1, 2.0, 1.0, **step), memory(0, 100, 100), memory(1, 100, 100)]
    records += [second, train(2, 1.5, 0.5, **step), *(memory(w, 100, 25) for w in range(4))]
    records += [third, train(3, 1.0, 0.5, **step), memory(0, 100, 50), memory(1, 100, 50)]
    run = load_run(write_run(tmp_path / "resumed", records))
    assert (run.strategy, run.workers) == ("zero2", 2)
    assert {w: r["peak"]["gradients"] for w, r in run.memory.items()} == {0: 50, 1: 50}
    text = summarize_run(run)
    assert text.splitlines()[0].endswith("strategy zero2, 2 worker(s)")
    assert (
        "  attempts            dp on 2 worker(s) -> zero2 on 4 worker(s) -> zero2 on 2 worker(s)"
        in text
    )
    # an attempt that failed before writing its ledger leaves the previous one's
    failed = write_run(tmp_path / "failed", [*records, config("dp"), train(4, 0.9, 0.1, **step)])
    assert sorted(load_run(failed).memory) == [0, 1]


def test_the_best_loss_is_the_first_time_the_lowest_eval_loss_was_logged(tmp_path):
    evals = [
        {"kind": "eval", "time_s": t, "step": s, "eval_loss": loss}
        for s, t, loss in ((2, 1.0, 1.5), (4, 2.0, 1.2), (6, 3.0, 1.2), (8, 4.0, 1.3))
    ]
    run = load_run(write_run(tmp_path / "r", [config(), train(8, 0.9, 4.0), *evals]))
    row = compare_rows([run])[0]
    assert (row.best_kind, row.best_loss, row.best_step, row.time_to_best_s) == (
        "eval",
        1.2,
        4,
        2.0,
    )
    assert row.samples_per_s is None and "-" in format_compare([row]).splitlines()[1]


def test_an_engine_without_a_ledger_reads_not_measured_not_zero():
    record = {"worker": 1, "peak": {}, "peak_total": 0, "budget": None}
    assert memory_line(record) == (
        "  memory worker 1     not measured (this engine keeps no memory ledger)"
    )


def test_a_folder_without_metrics_is_refused(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    write_run(tmp_path / "b", [config()])
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "holds no metrics.jsonl; pass the folder of a paratrain run" in capsys.readouterr().err


def test_the_comparison_legend_names_each_run_once(tmp_path):
    pytest.importorskip("matplotlib")
    from paratrain.reports.plot import build_figure

    names = ("dp-a", "zero2-b", "ps-c")
    runs = [
        load_run(write_run(tmp_path / name, [config(name.split("-")[0]), train(1, 2.0, 0.1)]))
        for name in names
    ]
    figure, _ = build_figure(runs)
    assert len(figure.legends) == 1
    assert [text.get_text() for text in figure.legends[0].get_texts()] == list(names)
    figure.canvas.draw()  # laid out: the legend sits above every panel, not under them
    top = max(ax.get_window_extent().y1 for ax in figure.axes if ax.get_visible())
    assert figure.legends[0].get_window_extent().y0 >= top


def test_each_later_attempt_is_marked_where_it_took_over(tmp_path):
    """A resume (attempt 0 of a later launch) and a restart after a failed worker; the
    config record says the step each started from."""
    pytest.importorskip("matplotlib")
    from paratrain.reports.plot import ATTEMPT_GID, PANEL_TITLES, build_figure

    records = [
        config(),
        train(1, 2.0, 1.0),
        train(4, 1.8, 4.0),
        {**config(), "start_step": 4, "attempt": 0, "resumed_from": "r/checkpoints/step-4"},
        train(5, 1.7, 1.0),
        train(6, 1.6, 2.0),
        {**config(), "start_step": 6, "attempt": 1, "resumed_from": "r/checkpoints/step-6"},
        train(8, 1.5, 1.5),
    ]
    run = load_run(write_run(tmp_path / "run", records))
    assert [(a.step, a.time_s, a.restart) for a in run.attempts] == [
        (4, 4.0, False),
        (6, 6.0, True),
    ]
    figure, titles = build_figure([run])
    axes = dict(zip(titles, figure.axes, strict=False))
    for title, where in (
        (PANEL_TITLES["loss_step"], [4, 6]),
        (PANEL_TITLES["loss_time"], [4.0, 6.0]),
    ):
        marks = [line for line in axes[title].lines if line.get_gid() == ATTEMPT_GID]
        assert [line.get_xdata()[0] for line in marks] == where
        labels = [text.get_text() for text in axes[title].get_legend().get_texts()]
        assert labels[-1] == "attempt starts (resume / restart)"


def test_an_attempt_recorded_before_its_start_step_is_marked_at_its_first_logged_step(
    tmp_path,
):
    records = [config(), train(2, 2.0, 1.0), config(), train(3, 1.9, 0.5)]
    run = load_run(write_run(tmp_path / "old", records))
    assert [(a.step, a.time_s, a.restart) for a in run.attempts] == [(3, 1.0, False)]


def test_an_elastic_runs_worker_changes_are_marked_counted_and_tabled(tmp_path):
    """Two ``workers`` records (worker 1 lost in step 2, worker 4 joined after step 4):
    a dotted line with its label on the loss and throughput panels, the counts in the
    report's text and the comparison's workers column."""
    pytest.importorskip("matplotlib")
    from paratrain.reports.plot import PANEL_TITLES, WORKERS_GID, build_figure

    lost = {"step": 2, "old_workers": 4, "new_workers": 3, "lost_ranks": [1]}
    joined = {"step": 4, "old_workers": 3, "new_workers": 4, "joined_ranks": [4]}
    records = [
        {**config(), "workers": 4},
        train(1, 2.0, 1.0, samples_per_s=0.0),
        {"kind": "workers", "time_s": 2.5, **lost, "seconds_lost": 0.4, "steps_redone": 1},
        train(3, 1.8, 3.0, samples_per_s=90.0),
        {"kind": "workers", "time_s": 4.5, **joined, "seconds_lost": 0.2, "steps_redone": 0},
        train(6, 1.6, 6.0, samples_per_s=100.0),
    ]
    run = load_run(write_run(tmp_path / "elastic", records))
    figure, titles = build_figure([run])
    axes = dict(zip(titles, figure.axes, strict=False))
    for title, where in (
        (PANEL_TITLES["loss_step"], [2, 4]),
        (PANEL_TITLES["loss_time"], [2.5, 4.5]),
        (PANEL_TITLES["throughput"], [2, 4]),
    ):
        marks = [line for line in axes[title].lines if line.get_gid() == WORKERS_GID]
        assert [line.get_xdata()[0] for line in marks] == where
        notes = [t.get_text() for t in axes[title].texts if t.get_gid() == WORKERS_GID]
        assert notes == ["4->3 (-1)", "3->4 (+4)"]
        labels = [text.get_text() for text in axes[title].get_legend().get_texts()]
        assert labels[-1] == "worker count changes (elastic)"
    assert (
        "  workers             4 at the start, 4 at the end; step 2: 4 -> 3 (lost 1; 1 step(s) "
        "redone, 0.40 s lost), step 4: 3 -> 4 (joined 4; 0 step(s) redone, 0.20 s lost)"
    ) in summarize_run(run).splitlines()
    row = compare_rows([run])[0]
    assert row.workers == "4->3->4"
    assert format_compare([row]).splitlines()[0].split()[:3] == ["run", "strategy", "workers"]
